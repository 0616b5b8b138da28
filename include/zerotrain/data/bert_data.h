// Pre-training data for the reference BERT (docs/bert.md): special tokens after a content
// vocabulary, sentence pairs [CLS] A [SEP] B [SEP] cut from a token stream, and masked language
// modelling's masking, all deterministic and distributed as DistributedSampler (zerotrain/data/data.h).
//
// Special tokens: the content vocabulary (256 byte values for the byte tokenizer, or the ids a
// `.bin` file was made with) is followed by [CLS], [SEP], [MASK] and [PAD], in that order, so the
// byte tokenizer's BERT vocabulary has 260 ids: [CLS]=256, [SEP]=257, [MASK]=258, [PAD]=259.
// Content ids keep their values; no content id can be mistaken for a special one.
//
// Determinism: everything a sample gets (its pair, its next-sentence label, its masking) is a
// function of (seed, step, global sample index g), with g numbered as DistributedSampler numbers
// its samples: rank r at micro-step a takes g = a·(W·M) + r·M + i, i in [0, M). A step's data is
// therefore the same for any world size W with the global batch fixed, and concatenating the
// ranks' micro-batches in rank order gives the one-rank micro-batch.
//
// Errors: bad sizes or probabilities throw zt::ConfigError naming the field; data that is too
// short, or that holds ids outside the content vocabulary, throws zt::DataError naming the source.
// Thread safety: MlmMasker and SentencePairSampler are immutable after construction.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include <ATen/core/Tensor.h>

#include "zerotrain/data/data.h"

namespace zt {

// The ids of BERT's special tokens after a content vocabulary of `content_vocab` ids.
struct BertSpecialTokens {
  int64_t content_vocab = ByteTokenizer::kVocabSize;
  int64_t cls() const { return content_vocab; }
  int64_t sep() const { return content_vocab + 1; }
  int64_t mask() const { return content_vocab + 2; }
  int64_t pad() const { return content_vocab + 3; }
  // Content ids plus the four specials: 260 for the byte tokenizer.
  int64_t vocab_size() const { return content_vocab + 4; }
  bool is_special(int64_t id) const { return id >= content_vocab; }
};

// One BERT pre-training micro-batch, int64 tensors on the CPU (B sequences of T tokens).
struct BertBatch {
  at::Tensor input_ids;       // [B,T], after masking when masked
  at::Tensor token_type_ids;  // [B,T]: 0 for [CLS] A [SEP], 1 for B [SEP], 0 on padding
  at::Tensor attention_mask;  // [B,T]: 1 on tokens, 0 on [PAD]
  // Masked language modelling: flat indices b·T + t of the masked positions (ascending), and the
  // original ids there. Undefined until MlmMasker::apply.
  at::Tensor masked_positions;  // [M]
  at::Tensor masked_labels;     // [M]
  // Next-sentence prediction: 0 when B is the text that follows A, 1 when B is a random segment
  // (the convention of BERT's and Hugging Face's next_sentence_label). [B]; may be undefined.
  at::Tensor nsp_labels;
};

// ---- masking ------------------------------------------------------------------------------

struct MlmOptions {
  double probability = 0.15;  // share of a sequence's content positions that are predicted
  double mask = 0.8;          // of those: replaced by [MASK]
  double random = 0.1;        //           replaced by a uniformly drawn content id
                              //           the rest (0.1) keep their id
  int64_t max_predictions = 0;  // at most this many per sequence (BERT: 20 at 128 tokens); 0: no cap

  // Throws zt::ConfigError naming the field unless 0 < probability <= 1, mask and random are in
  // [0, 1] with mask + random <= 1, and max_predictions >= 0.
  void validate() const;
};

// BERT's masking (Devlin et al. 2019, create_pretraining_data.py): in each sequence, of the n
// content positions (not a special token, not padding) exactly k = max(1, round(probability·n))
// are chosen uniformly without replacement (k capped at max_predictions when set, and at n).
// Each chosen position independently becomes [MASK] with probability `mask`, a uniform content
// id with probability `random` (which may equal the original id), and keeps its id otherwise; it
// is predicted in all three cases. Special tokens and padding are never chosen. A sequence with
// no content position gets no prediction.
class MlmMasker {
 public:
  MlmMasker(MlmOptions options, BertSpecialTokens specials, uint64_t seed);

  // Masks batch.input_ids in place and sets masked_positions and masked_labels. Row i of the
  // batch is global sample first_global_sample + i at `step`; its masking depends on (seed, step,
  // that index) only. Throws zt::ConfigError on a batch without input_ids [B,T] int64, or with
  // an attention_mask of another shape.
  void apply(BertBatch& batch, int64_t step, int64_t first_global_sample) const;

  // One sequence: rewrites `tokens` (content ids, specials; padding is [PAD]) and appends the
  // chosen positions (indices into `tokens`, ascending) and their original ids.
  void mask_sequence(std::span<int64_t> tokens, int64_t step, int64_t global_sample, std::vector<int64_t>& positions,
                     std::vector<int64_t>& labels) const;

  const MlmOptions& options() const { return options_; }
  const BertSpecialTokens& specials() const { return specials_; }

 private:
  MlmOptions options_;
  BertSpecialTokens specials_;
  uint64_t seed_;
};

// ---- sentence pairs -----------------------------------------------------------------------

struct SentencePairOptions {
  int64_t max_length = 128;        // T: the whole sequence, [CLS] and both [SEP] included (>= 5)
  double next_probability = 0.5;   // B is A's continuation with this probability, else random
  BertSpecialTokens specials{};    // content_vocab: every dataset id must be below it
  // Tokens that end a sentence (for the byte tokenizer '.', '!', '?' and newline); empty: the
  // segments are cut at lengths only.
  std::vector<uint16_t> sentence_ends = {'.', '!', '?', '\n'};
  // Tokens skipped at the start of a segment (spaces and newlines after a sentence end).
  std::vector<uint16_t> leading_skip = {' ', '\n'};

  void validate() const;  // zt::ConfigError naming the field
};

// Sentence pairs cut from one token stream, without an index of the stream (a `.bin` file of any
// size is neither read up front nor copied). The rule, with L = max_length - 3 content tokens:
//  - A sentence is a run of tokens ending with a sentence end (inclusive). A segment starts at a
//    sentence start: position 0, or the first position after a sentence end, after skipping
//    leading_skip tokens. From a position p the segment starts at the first sentence start at or
//    after p within L tokens; when there is none (no sentence end in reach), at p itself.
//  - A takes a length budget drawn uniformly from [1, L-1], B the rest (L - |A|). Each takes the
//    whole sentences from its start that fit its budget; when even the first one does not fit,
//    it is cut at the budget (a fixed-length cut).
//  - A starts from a position drawn uniformly from the first n - 5L tokens. With probability
//    next_probability (nsp label 0) B starts at the first segment start after A's end (A's
//    continuation in the stream); otherwise (label 1) from a position drawn uniformly from the
//    first n - 2L tokens. With no documents to draw from, a random B lands within reach of A with
//    probability about 3L/n: negligible for any real corpus, and accepted.
//  - The sequence is [CLS] A [SEP] B [SEP] then [PAD] up to max_length, token types 0 up to the
//    first [SEP] and 1 for B and its [SEP], attention mask 1 on every token but padding.
// The dataset needs at least 5L + 1 tokens (zt::DataError otherwise), so that every segment
// start and every segment lies inside it.
class SentencePairSampler {
 public:
  // Throws zt::ConfigError for non-positive sizes or rank outside [0, world_size), and
  // zt::DataError for a dataset shorter than 5L + 1 tokens.
  SentencePairSampler(const TokenDataset& data, SentencePairOptions options, int64_t micro_batch, int world_size,
                      int rank, uint64_t seed);

  // The unmasked micro-batch of (step, micro_step) on this rank: input_ids, token_type_ids,
  // attention_mask and nsp_labels. Throws zt::DataError on a dataset id outside the content
  // vocabulary (naming the source and the position).
  BertBatch pairs(int64_t step, int64_t micro_step) const;
  // pairs() masked by `masker` with the same (step, global sample) keys. Throws zt::ConfigError
  // when the masker's content vocabulary is not this sampler's.
  BertBatch batch(int64_t step, int64_t micro_step, const MlmMasker& masker) const;

  // Global sample index of row 0 of this rank's micro-batch at `micro_step`.
  int64_t first_global_sample(int64_t micro_step) const;

  const SentencePairOptions& options() const { return options_; }
  int64_t micro_batch() const { return micro_batch_; }
  const TokenDataset& dataset() const { return data_; }

 private:
  void write_pair(int64_t step, int64_t global_sample, int64_t* ids, int64_t* types, int64_t* mask,
                  int64_t* nsp) const;

  TokenDataset data_;
  SentencePairOptions options_;
  int64_t micro_batch_;
  int world_size_, rank_;
  uint64_t seed_;
  std::vector<char> is_end_, is_skip_;  // indexed by token id (65536 entries)
};

}  // namespace zt
