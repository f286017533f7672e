"""Everything BRAG is built from beside its core, installed under one name.

``brag.py`` (the method), ``calibrate.py`` and ``app.py`` sit at the top of the checkout, with
``data/``; the rest is here:

- ``llms``: the LLM backends (HF Inference, any OpenAI-compatible endpoint, the embedded model),
  the response cache and the deadline every call runs under.
- ``documents``: files (PDF, Word, HTML, Markdown, text, passage JSON) read into passages.
- ``embedders``: dense embedders for retrieval and dedup.
- ``milvus``: a Milvus collection as a BRAG retriever.
- ``cli``: the ``brag`` command (``python -m brag``).
- ``storage``: where the evaluation data and installed packages are; atomic writes.
- ``serving``: the app's parts behind ``app.py`` (its uploads and its capped file readers too).

Importing this package imports none of them.
"""
