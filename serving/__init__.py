"""The app's parts behind ``app.py``, one idea per module.

- ``policy``: what a remote caller may send, pick and hold; refusals are ``RequestRefused``.
- ``guards``: the ASGI and Gradio guards in front of the endpoints.
- ``corpora``: the corpora a request can name, indexed once per process.
- ``presentation``: a report as the page shows it.
- ``server``: ``Settings`` and ``Server``, the ``/brag`` and ``/calibrate`` endpoints.

Imports point one way: ``policy`` <- ``corpora`` <- ``server``; ``presentation`` and ``guards``
import neither the server nor the page; ``app.py`` imports them all.
"""
