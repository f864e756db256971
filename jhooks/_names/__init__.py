"""Names you already know (TransformerLens'), translated to jhooks addresses.

Re-exports only; see README.md beside this file."""

from ._map import Name as Name
from ._transformer_lens import transformer_lens_names as transformer_lens_names
from ._translated import NameMap as NameMap
