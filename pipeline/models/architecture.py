"""What a loaded model's architecture lets the decode paths do, read from the model itself.

Kept with the models, below the decode package: loading decides whether a pair's passes go
through the static path (`models.static_passes`) from `static_support`, and the decode
package's runners ask the same questions of the models they are given.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from pipeline.models import invariant

# Models whose decoder layers are the plain pre-norm stack this runner drives (embeddings, layers
# with rotary positions, a final norm, an output layer); others run the dynamic path.
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
# Attention functions whose mask this runner can build: an additive one or a boolean one.
ADDITIVE, BOOLEAN = (invariant.NAME, "eager"), ("sdpa",)


def static_support(model: PreTrainedModel) -> str | None:
    """Why the static path (`pipeline.decode.static_lm`) cannot run `model` (None: it can)."""
    config = model.config
    if config.model_type not in FAMILIES:
        return f"model type {config.model_type!r} is not one of {FAMILIES}"
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return "sliding-window layers"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ADDITIVE + BOOLEAN:
        return f"attention implementation {implementation!r}"
    spread = set((getattr(model, "hf_device_map", None) or {}).values())
    if len(spread) > 1:  # `device_map="auto"` over several GPUs: the slots live on one device
        return f"the model is spread over {len(spread)} devices"
    base = model.base_model
    if not all(hasattr(base, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "not a plain decoder stack"
    if not plain_head(model):
        return "logits are more than the output layer"
    return None


def plain_head(model: PreTrainedModel) -> bool:
    """Are the model's logits its output layer applied to its last hidden states, bit for bit,
    and nothing more (no soft-capping or scaling, which Gemma 2 or Granite add)? Checked once
    per model on a 3-token input."""
    known = getattr(model, "_plain_head", None)
    if known is None:
        ids = torch.tensor([[1, 2, 3]], device=next(model.parameters()).device)
        with torch.no_grad():
            own = model(input_ids=ids, use_cache=False).logits
            hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
            known = torch.equal(own.float(), model.get_output_embeddings()(hidden).float())
        model._plain_head = known
    return known
