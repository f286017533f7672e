"""The app's parts behind ``app.py``, one idea per module.

- ``policy``: what a remote caller may send, pick and hold; refusals are ``RequestRefused``.
- ``guards``: the ASGI and Gradio guards in front of the endpoints.
- ``corpora``: the corpora a request can name, indexed once per process.
- ``presentation``: a report as the page shows it.
- ``server``: ``Settings`` and ``Server``, the ``/brag`` and ``/calibrate`` endpoints.

Imports point one way: ``policy`` is at the bottom (no Gradio); ``corpora`` and ``guards``
import it; ``server`` imports ``policy``, ``corpora`` and ``presentation``; none imports the
page, ``app.py``, which imports them all.
"""
