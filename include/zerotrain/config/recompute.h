// What activation checkpointing keeps of a block for backward (docs/activation_checkpointing.md):
// plain data of the configuration layer, so that the memory estimate, the step-time model and
// the models' FLOP counts name a policy without depending on the blocks that run it
// (zerotrain/zero/blocks.h).
#pragma once

namespace zt {

// Everything (None), the block's matrix-multiply outputs but not the attention scores and the
// activation function's output (Selective: the model decides what is cheap to recompute), or
// its input only (Full).
enum class Recompute { None, Selective, Full };
// "none", "selective", "full".
const char* to_string(Recompute recompute);

}  // namespace zt
