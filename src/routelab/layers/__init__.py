"""Layers users put in their models: MoE feed-forward layers, multi-gate MoE, mixture of
attentive experts."""

# Each layer lives in its own module; add its public names here.
__all__: list[str] = []

from routelab.layers.mae import MixtureOfAttentiveExperts  # noqa: E402

__all__ += ["MixtureOfAttentiveExperts"]

from routelab.layers.multigate import MultiGateMoE, SharedBottom, StackedLinear  # noqa: E402

__all__ += ["MultiGateMoE", "SharedBottom", "StackedLinear"]

from routelab.layers.config import MoEConfig  # noqa: E402
from routelab.layers.experts import StackedExperts  # noqa: E402
from routelab.layers.moe import MoE  # noqa: E402

__all__ += ["MoE", "MoEConfig", "StackedExperts"]
