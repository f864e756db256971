"""Kept for pickles made by jhooks 0.2, which name `jhooks._hookable._unpickle`.

The code lives in `jhooks/_modules/_hookable.py`; `tests/test_modules_pickle.py` loads a
pickle written by 0.2.
"""

from ._modules import unpickle as _unpickle  # noqa: F401
