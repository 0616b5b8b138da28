// The Llama-family decoder's activations for the memory estimate (zerotrain/memory/estimate.h
// transformer_activation_bytes, which calls it for ModelFigures::Family::Llama). Internal.
#pragma once
#include "zerotrain/memory/estimate.h"

namespace zt {

// As transformer_activation_bytes, for the tensors src/models/llama.cpp keeps (docs/memory.md
// "Activations", the Llama). Selective recomputation counts as none (the model refuses it).
ActivationBytes llama_activation_bytes(const ModelFigures& model, int64_t micro_batch, int element_bytes,
                                       Recompute recompute);

}  // namespace zt
