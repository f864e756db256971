"""Attribution: AtP, AtP*, integrated gradients, EAP and EAP-IG; autoencoders spliced in.

Re-exports only; see README.md beside this file."""

from ._api import attribution as attribution
from ._splice import splice as splice
