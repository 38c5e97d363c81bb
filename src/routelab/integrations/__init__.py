"""Adapters between other libraries' models and routelab's routers (layer 5).

No routing logic lives here, only translation between the other library's contracts and
routelab's: :mod:`routelab.integrations.hf` puts any routelab router into the sparse MoE blocks
of Hugging Face transformers models (``patch_moe``). The adapters import their library lazily, so
``import routelab.integrations`` works without it.
"""

__all__ = ["hf"]
