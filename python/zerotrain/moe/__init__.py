"""deepspeed.moe: zerotrain has no expert parallelism. A mixture of experts written as an ordinary
module trains as any module does (at stage 3 as one leaf unit: docs/python.md "Stage 3: units");
DeepSpeed's own MoE layer, whose experts are spread over ranks, is not supported."""
from . import layer, utils  # noqa: F401
