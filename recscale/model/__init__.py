"""Models: MLP towers, feature interactions and DLRM."""

from recscale.model.dcn import DCNInteraction, LowRankCrossNet
from recscale.model.dlrm import DLRM
from recscale.model.interaction import DotInteraction
from recscale.model.mlp import MLP

__all__ = ["DLRM", "MLP", "DCNInteraction", "DotInteraction", "LowRankCrossNet"]
