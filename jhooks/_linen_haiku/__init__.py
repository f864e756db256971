"""Flax Linen and Haiku models by name: their module calls are scopes of runs, their
outputs points, the operations inside addressable; no module hooks (they refuse).

Importing this package registers both libraries' interceptors with `jhooks._runs` and
their refusals with `jhooks._modules` (`_framework.py`), and imports neither library.
See README.md beside this file."""

from ._framework import HAIKU_REFUSAL as HAIKU_REFUSAL
from ._framework import LINEN_REFUSAL as LINEN_REFUSAL
