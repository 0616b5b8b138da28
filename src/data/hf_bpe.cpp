#include "data/hf_bpe.h"

#include <algorithm>
#include <cstdio>
#include <queue>

#include "common/printable.h"
#include "data/hf_utf8.h"
#include "zerotrain/error.h"

namespace zt::hf {

ByteUnicodeMap::ByteUnicodeMap() {
  byte_of_char_.fill(-1);
  auto printable = [](int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF); };
  char32_t next_unprintable = 256;
  for (int b = 0; b < 256; ++b) {
    const char32_t c = printable(b) ? char32_t(b) : next_unprintable++;
    chars_[b] = c;
    utf8_[b] = utf8_encode(c);
    byte_of_char_[c] = int16_t(b);
  }
}

const ByteUnicodeMap& ByteUnicodeMap::instance() {
  static const ByteUnicodeMap map;
  return map;
}

std::optional<uint8_t> ByteUnicodeMap::byte_of(char32_t c) const {
  if (c >= byte_of_char_.size() || byte_of_char_[c] < 0) return std::nullopt;
  return uint8_t(byte_of_char_[c]);
}

void ByteUnicodeMap::append_mapped(std::string_view raw, std::string& out) const {
  for (const char byte : raw) out += utf8_[static_cast<unsigned char>(byte)];
}

namespace {

uint64_t pair_key(TokenId left, TokenId right) { return (uint64_t(left) << 32) | right; }

std::string byte_token(uint8_t byte) {
  char buffer[8];
  std::snprintf(buffer, sizeof buffer, "<0x%02X>", byte);
  return buffer;
}

}  // namespace

BpeModel::BpeModel(StringMap<TokenId> vocab, const std::vector<std::pair<std::string, std::string>>& merges,
                   BpeOptions options, const std::string& where)
    : vocab_(std::move(vocab)), options_(std::move(options)) {
  TokenId largest = 0;
  for (const auto& [token, id] : vocab_) largest = std::max(largest, id);
  tokens_by_id_.resize(vocab_.empty() ? 0 : size_t(largest) + 1);
  for (const auto& [token, id] : vocab_) tokens_by_id_[id] = token;

  auto lookup = [&](const std::string& token, size_t rank) {
    auto it = vocab_.find(token);
    if (it == vocab_.end())
      throw DataError(where + ": model.merges[" + std::to_string(rank) + "] needs the token \"" + printable_utf8(token, 80) +
                      "\", which model.vocab does not have");
    return it->second;
  };
  merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    const TokenId left_id = lookup(left, rank), right_id = lookup(right, rank);
    const TokenId merged_id = lookup(left + right, rank);
    // A later duplicate of a pair replaces the earlier one, as in the Rust library's map.
    merges_[pair_key(left_id, right_id)] = MergeResult{uint32_t(rank), merged_id};
  }
  if (options_.unk_token) {
    auto it = vocab_.find(*options_.unk_token);
    if (it == vocab_.end())
      throw DataError(where + ": model.unk_token \"" + printable_utf8(*options_.unk_token, 80) + "\" is not in model.vocab");
    unk_id_ = it->second;
  }
  if (options_.byte_fallback)
    for (int b = 0; b < 256; ++b)
      if (auto it = vocab_.find(byte_token(uint8_t(b))); it != vocab_.end()) byte_fallback_ids_[b] = it->second;
}

std::optional<TokenId> BpeModel::token_to_id(std::string_view token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::id_to_token(TokenId id) const {
  if (id >= tokens_by_id_.size()) return nullptr;
  const std::string& token = tokens_by_id_[id];
  // An empty slot is a gap in the ids; the empty string is never a BPE token of a valid file.
  if (token.empty() && !vocab_.contains(std::string_view())) return nullptr;
  return &token;
}

std::optional<BpeModel::MergeResult> BpeModel::find_merge(TokenId left, TokenId right) const {
  auto it = merges_.find(pair_key(left, right));
  if (it == merges_.end()) return std::nullopt;
  return it->second;
}

void BpeModel::encode_word(std::string_view word, bool byte_level, std::vector<TokenId>& out) const {
  const bool cacheable = word.size() < kCacheMaxWordBytes;
  CacheShard& shard = cache_[StringHash{}(word) % kCacheShards];
  if (cacheable) {
    std::lock_guard lock(shard.mutex);
    if (auto it = shard.words.find(word); it != shard.words.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::string mapped;
  std::string_view symbols = word;
  if (byte_level) {
    mapped.reserve(word.size() * 2);
    ByteUnicodeMap::instance().append_mapped(word, mapped);
    symbols = mapped;
  }
  const size_t first = out.size();
  if (auto whole = options_.ignore_merges ? token_to_id(symbols) : std::nullopt)
    out.push_back(*whole);
  else
    merge_word(symbols, out);
  if (cacheable) {
    std::lock_guard lock(shard.mutex);
    if (shard.words.size() < kCacheCapacity / kCacheShards)
      shard.words.emplace(std::string(word), std::vector<TokenId>(out.begin() + long(first), out.end()));
  }
}

void BpeModel::initial_symbols(std::string_view word, std::vector<TokenId>& ids, std::vector<uint32_t>& lengths) const {
  std::optional<std::pair<TokenId, uint32_t>> pending_unk;
  auto flush_unk = [&] {
    if (pending_unk) {
      ids.push_back(pending_unk->first);
      lengths.push_back(pending_unk->second);
      pending_unk.reset();
    }
  };
  for (size_t at = 0; at < word.size();) {
    const size_t length = utf8_length(static_cast<unsigned char>(word[at]));
    const std::string_view character = word.substr(at, length);
    at += length;
    if (auto id = token_to_id(character)) {
      flush_unk();
      ids.push_back(*id);
      lengths.push_back(uint32_t(length));
      continue;
    }
    if (options_.byte_fallback) {
      bool all_bytes = true;
      for (const char byte : character) all_bytes = all_bytes && byte_fallback_ids_[static_cast<unsigned char>(byte)];
      if (all_bytes) {
        // Pending unknowns stay pending across byte tokens, as in the Rust library.
        for (const char byte : character) {
          ids.push_back(*byte_fallback_ids_[static_cast<unsigned char>(byte)]);
          lengths.push_back(1);
        }
        continue;
      }
    }
    if (!unk_id_) continue;  // no unknown token: the character is dropped
    if (pending_unk && options_.fuse_unk) {
      pending_unk->second += uint32_t(length);
    } else {
      flush_unk();
      pending_unk = std::pair{*unk_id_, uint32_t(length)};
    }
  }
  flush_unk();
}

void BpeModel::merge_word(std::string_view word, std::vector<TokenId>& out) const {
  std::vector<TokenId> ids;
  std::vector<uint32_t> lengths;
  initial_symbols(word, ids, lengths);
  const int count = int(ids.size());
  if (count == 0) return;
  std::vector<int> prev(count), next(count);
  for (int i = 0; i < count; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < count ? i + 1 : -1;
  }
  // Lowest rank first, then leftmost: the order of the Rust library's heap.
  struct Candidate {
    uint32_t rank;
    int position;
    TokenId new_id;
    bool operator<(const Candidate& other) const {
      return rank != other.rank ? rank > other.rank : position > other.position;
    }
  };
  std::priority_queue<Candidate> queue;
  for (int i = 0; i + 1 < count; ++i)
    if (auto merge = find_merge(ids[i], ids[i + 1])) queue.push({merge->rank, i, merge->new_id});
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    const int left = top.position;
    if (lengths[left] == 0 || next[left] == -1) continue;
    const int right = next[left];
    const auto current = find_merge(ids[left], ids[right]);
    if (!current || current->new_id != top.new_id) continue;  // a stale candidate
    ids[left] = top.new_id;
    lengths[left] += lengths[right];
    lengths[right] = 0;
    next[left] = next[right];
    if (next[right] != -1) prev[next[right]] = left;
    if (prev[left] != -1)
      if (auto merge = find_merge(ids[prev[left]], ids[left])) queue.push({merge->rank, prev[left], merge->new_id});
    if (next[left] != -1)
      if (auto merge = find_merge(ids[left], ids[next[left]])) queue.push({merge->rank, left, merge->new_id});
  }
  for (int i = 0; i < count; ++i)
    if (lengths[i] != 0) out.push_back(ids[i]);
}

}  // namespace zt::hf
