"""deepspeed.moe.layer: DeepSpeed's expert-parallel MoE layer, not supported by zerotrain."""
from .. import _unsupported

MoE = _unsupported.cls("deepspeed.moe.layer.MoE", "write the experts as an ordinary module and flag it a "
                       "stage-3 leaf with zerotrain.utils.set_z3_leaf_modules")
