"""Interoperability with other ecosystems: Hugging Face ``transformers`` checkpoints (``hf``).

``transformers`` is imported only inside the functions that need it (it takes seconds to
import), so importing this package stays cheap for the trainer.
"""

from loomtrain.interop.hf import (
    export_hf,
    from_hf_state_dict,
    hf_tokenizer,
    load_hf_weights,
    resolve_init_from,
    to_hf_state_dict,
)

__all__ = [
    "export_hf",
    "from_hf_state_dict",
    "hf_tokenizer",
    "load_hf_weights",
    "resolve_init_from",
    "to_hf_state_dict",
]
