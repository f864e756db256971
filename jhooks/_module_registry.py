"""Kept for pickles made by jhooks 0.2, which name `jhooks._module_registry._Registry`.

The code lives in `jhooks/_modules/_registry.py`; `tests/test_modules_pickle.py` loads a
pickle written by 0.2.
"""

from ._modules import Registry as _Registry  # noqa: F401
