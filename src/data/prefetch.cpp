#include "zerotrain/data/data.h"

namespace zt {

// The one instantiation for the GPT's batches; other batch types (the BERT's) are instantiated
// where they are used.
template class Prefetcher<Batch>;

}  // namespace zt
