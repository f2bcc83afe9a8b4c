"""Every reach into a library's internals, in one place, named after what it is for.

transformers, vLLM, Ray and Lightning are pinned (``pyproject.toml``), but the library also uses
a few things they do not document: private attributes (``config._attn_implementation``), private
modules (vLLM's worker and model-loader internals), undocumented object chains
(``trainer.fit_loop.epoch_loop.val_loop``) and internal configuration variables. Each such use is
one small function here, one module per library, whose docstring names the internal it relies
on and the version it was checked on. The rest of the package calls these functions, never the
internals themselves.

Each function is pinned by a test in ``tests/compat/`` (``test_<library>.py``) that exercises the
behaviour relied on with real objects, so that an upgrade which changes an internal fails one
named test instead of a training run.
"""
