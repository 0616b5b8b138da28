// The built-in corpus (see embedded_corpus() in data.h).
//
// What it is: procedurally generated English-like prose over a fixed vocabulary of about 300 words
// (30 names, 60 nouns, 40 adjectives, 32 verbs, places, times, adverbs, picked with Zipfian
// frequencies), built from templates with real grammatical structure: narrative sentences ("In
// the morning, the old farmer found a red box near the river."), descriptions, fixed world facts
// that are always stated the same way ("The apple is red." — a small memorisation signal),
// arithmetic facts ("12 plus 7 is 19."), counting
// stories whose numbers must add up, and short quoted question/answer dialogues. Sentences are
// grouped into paragraphs separated by blank lines.
//
// Why generated instead of shipped: no download and no binary blob in the repository, yet the
// text is byte-identical everywhere because it uses only a fixed-seed SplitMix64 generator and
// integer arithmetic (no std:: distributions, whose output is implementation-defined). Its
// regularity lets a small byte-level GPT drop from ~ln(256)=5.5 to about 2.2 nats per byte within
// 200 steps (tiny preset, 16×64 tokens, AdamW 3e-3; small preset, 16×128 tokens, AdamW 1e-3),
// which makes it a useful smoke test for every training path.
#include <array>
#include <cstdint>
#include <string>

#include "zerotrain/data/data.h"
// GCC 12 reports a false -Wstringop-overflow inside std::string concatenation at -O2 (GCC bug
// 105329); the concatenations here are ordinary.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#endif

namespace zt {
namespace {

constexpr size_t kTargetBytes = 1'500'000;
constexpr uint64_t kCorpusSeed = 0x5A45524F54524E31ULL;  // "ZEROTRN1"

class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  int below(int n) { return static_cast<int>(next() % static_cast<uint64_t>(n)); }
  int range(int lo, int hi) { return lo + below(hi - lo + 1); }  // inclusive
  bool chance(int percent) { return below(100) < percent; }
  // Word choices follow Zipf's law (weight of the i-th entry ∝ 1/(i+1)), as word frequencies in
  // real text do: frequent words are learned first, which makes early training progress visible.
  // Integer weights keep the output platform-independent.
  template <class T, size_t N>
  const T& pick(const std::array<T, N>& a) {
    constexpr int64_t kScale = 1'000'000;
    int64_t total = 0;
    for (size_t i = 0; i < N; ++i) total += kScale / static_cast<int64_t>(i + 1);
    int64_t r = static_cast<int64_t>(next() % static_cast<uint64_t>(total));
    for (size_t i = 0; i < N; ++i) {
      r -= kScale / static_cast<int64_t>(i + 1);
      if (r < 0) return a[i];
    }
    return a[N - 1];
  }

 private:
  uint64_t s_;
};

struct Name {
  const char* name;
  bool she;
};
struct Noun {
  const char* one;
  const char* many;
};
struct Verb {
  const char* base;
  const char* past;
  const char* third;  // third person singular present
};

const std::array<Name, 30> kNames = {{
    {"Anna", true},   {"Ben", false},   {"Clara", true}, {"David", false}, {"Emma", true},  {"Felix", false},
    {"Grace", true},  {"Henry", false}, {"Iris", true},  {"Jack", false},  {"Kate", true},  {"Leo", false},
    {"Mia", true},    {"Noah", false},  {"Olivia", true}, {"Paul", false}, {"Rosa", true},  {"Sam", false},
    {"Tom", false},   {"Uma", true},    {"Victor", false}, {"Wendy", true}, {"Max", false}, {"Lily", true},
    {"Oscar", false}, {"Ruby", true},   {"Hugo", false}, {"Nora", true},   {"Ella", true},  {"Finn", false},
}};

const std::array<Noun, 60> kNouns = {{
    {"cat", "cats"},       {"dog", "dogs"},         {"bird", "birds"},       {"tree", "trees"},
    {"house", "houses"},   {"river", "rivers"},     {"book", "books"},       {"apple", "apples"},
    {"ball", "balls"},     {"boat", "boats"},       {"car", "cars"},         {"garden", "gardens"},
    {"door", "doors"},     {"window", "windows"},   {"table", "tables"},     {"chair", "chairs"},
    {"cup", "cups"},       {"hill", "hills"},       {"road", "roads"},       {"city", "cities"},
    {"village", "villages"}, {"forest", "forests"}, {"flower", "flowers"},   {"stone", "stones"},
    {"star", "stars"},     {"moon", "moons"},       {"friend", "friends"},   {"teacher", "teachers"},
    {"farmer", "farmers"}, {"king", "kings"},       {"queen", "queens"},     {"child", "children"},
    {"box", "boxes"},      {"letter", "letters"},   {"song", "songs"},       {"story", "stories"},
    {"horse", "horses"},   {"fish", "fish"},        {"sheep", "sheep"},      {"mountain", "mountains"},
    {"lake", "lakes"},     {"bridge", "bridges"},   {"lamp", "lamps"},       {"key", "keys"},
    {"coin", "coins"},     {"cake", "cakes"},       {"shoe", "shoes"},       {"hat", "hats"},
    {"ship", "ships"},     {"train", "trains"},     {"field", "fields"},     {"school", "schools"},
    {"market", "markets"}, {"town", "towns"},       {"cloud", "clouds"},     {"rabbit", "rabbits"},
    {"fox", "foxes"},      {"mouse", "mice"},       {"baker", "bakers"},     {"robot", "robots"},
}};

const std::array<const char*, 40> kAdjectives = {
    "big",    "small",  "old",   "young",  "red",     "blue",  "green", "happy",  "sad",       "quiet",
    "loud",   "bright", "dark",  "warm",   "cold",    "tall",  "short", "little", "kind",      "brave",
    "clever", "gentle", "quick", "slow",   "strange", "heavy", "light", "yellow", "beautiful", "white",
    "black",  "busy",   "lazy",  "hungry", "tired",   "wise",  "new",   "soft",   "sweet",     "funny"};

const std::array<const char*, 8> kColors = {"red", "blue", "green", "yellow", "white", "black", "brown", "orange"};

const std::array<Verb, 20> kTransitive = {{
    {"see", "saw", "sees"},         {"find", "found", "finds"},       {"like", "liked", "likes"},
    {"take", "took", "takes"},      {"carry", "carried", "carries"},  {"watch", "watched", "watches"},
    {"help", "helped", "helps"},    {"paint", "painted", "paints"},   {"open", "opened", "opens"},
    {"follow", "followed", "follows"}, {"visit", "visited", "visits"}, {"build", "built", "builds"},
    {"draw", "drew", "draws"},      {"clean", "cleaned", "cleans"},   {"bring", "brought", "brings"},
    {"want", "wanted", "wants"},    {"love", "loved", "loves"},       {"hold", "held", "holds"},
    {"push", "pushed", "pushes"},   {"read", "read", "reads"},
}};

const std::array<Verb, 12> kIntransitive = {{
    {"walk", "walked", "walks"},   {"run", "ran", "runs"},       {"sleep", "slept", "sleeps"},
    {"sing", "sang", "sings"},     {"laugh", "laughed", "laughs"}, {"jump", "jumped", "jumps"},
    {"swim", "swam", "swims"},     {"wait", "waited", "waits"},  {"smile", "smiled", "smiles"},
    {"dance", "danced", "dances"}, {"rest", "rested", "rests"},  {"play", "played", "plays"},
}};

const std::array<const char*, 9> kPrepositions = {"in",     "near", "under",  "on",    "behind",
                                                  "beside", "by",   "across", "inside"};
const std::array<const char*, 10> kTimes = {"In the morning", "At night",    "Every day",       "After lunch",
                                            "On Sunday",      "One day",     "Later",           "In the evening",
                                            "Before dinner",  "Long ago"};
const std::array<const char*, 6> kAdverbs = {"slowly", "quickly", "quietly", "happily", "carefully", "loudly"};
const std::array<const char*, 21> kNumberWords = {
    "zero",   "one",    "two",     "three",    "four",     "five",    "six",
    "seven",  "eight",  "nine",    "ten",      "eleven",   "twelve",  "thirteen",
    "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"};

std::string capitalize(std::string s) {
  if (!s.empty() && s[0] >= 'a' && s[0] <= 'z') s[0] = static_cast<char>(s[0] - 'a' + 'A');
  return s;
}

class Generator {
 public:
  Generator() : rng_(kCorpusSeed) {
    // Fixed world facts: every noun has one colour for the whole corpus.
    for (auto& c : color_of_) c = rng_.below(static_cast<int>(kColors.size()));
  }

  std::string run() {
    std::string out;
    out.reserve(kTargetBytes + 4096);
    while (out.size() < kTargetBytes) {
      paragraph(out);
      out += "\n\n";
    }
    return out;
  }

 private:
  const Noun& noun() { return rng_.pick(kNouns); }
  // "the old farmer" / "a cat" / "Anna"
  std::string noun_phrase(bool allow_name) {
    if (allow_name && rng_.chance(35)) return rng_.pick(kNames).name;
    const std::string adj = rng_.chance(55) ? std::string(rng_.pick(kAdjectives)) + " " : "";
    const std::string n = noun().one;
    if (rng_.chance(70)) return "the " + adj + n;
    const char first = adj.empty() ? n[0] : adj[0];
    return (std::string("aeiou").find(first) != std::string::npos ? "an " : "a ") + adj + n;
  }
  std::string place() { return std::string(rng_.pick(kPrepositions)) + " the " + noun().one; }

  void narrative(std::string& out) {
    std::string s;
    if (rng_.chance(40)) s = std::string(rng_.pick(kTimes)) + ", ";
    std::string subj = noun_phrase(true);
    s += s.empty() ? capitalize(subj) : subj;
    if (rng_.chance(60)) {
      s += " " + std::string(rng_.pick(kTransitive).past) + " " + noun_phrase(true);
    } else {
      s += " " + std::string(rng_.pick(kIntransitive).past);
      if (rng_.chance(50)) s += " " + std::string(rng_.pick(kAdverbs));
    }
    if (rng_.chance(60)) s += " " + place();
    out += s + ".";
  }

  void present(std::string& out) {
    const Name& n = rng_.pick(kNames);
    const Noun& obj = noun();
    out += std::string(n.name) + " " + rng_.pick(kTransitive).third + " " + obj.many + ", and " +
           (n.she ? "she " : "he ") + rng_.pick(kIntransitive).third + " " + rng_.pick(kAdverbs) + ".";
  }

  void description(std::string& out) {
    if (rng_.chance(50)) {
      const Name& n = rng_.pick(kNames);
      out += std::string(n.name) + " is " + rng_.pick(kAdjectives) + " and " + rng_.pick(kAdjectives) + ".";
    } else {
      out += "The " + std::string(noun().one) + " " + place() + " is " + rng_.pick(kAdjectives) + ".";
    }
  }

  void fact(std::string& out) {
    const int i = rng_.below(static_cast<int>(kNouns.size()));
    out += "The " + std::string(kNouns[i].one) + " is " + kColors[color_of_[i]] + ".";
  }

  void arithmetic(std::string& out) {
    const int op = rng_.below(3);
    if (op == 0) {
      const int a = rng_.range(0, 50), b = rng_.range(0, 50);
      out += std::to_string(a) + " plus " + std::to_string(b) + " is " + std::to_string(a + b) + ".";
    } else if (op == 1) {
      const int a = rng_.range(0, 60), b = rng_.range(0, a);
      out += std::to_string(a) + " minus " + std::to_string(b) + " is " + std::to_string(a - b) + ".";
    } else {
      const int a = rng_.range(1, 12), b = rng_.range(1, 12);
      out += std::to_string(a) + " times " + std::to_string(b) + " is " + std::to_string(a * b) + ".";
    }
  }

  void counting(std::string& out) {
    const Name& a = rng_.pick(kNames);
    const Name* b = &rng_.pick(kNames);
    while (b == &a) b = &rng_.pick(kNames);
    const Noun& thing = noun();
    const int n = rng_.range(2, 10), m = rng_.range(1, 10);
    out += std::string(a.name) + " has " + kNumberWords[n] + " " + thing.many + ". " + b->name + " gives " +
           (a.she ? "her " : "him ") + kNumberWords[m] + " more. Now " + a.name + " has " + kNumberWords[n + m] +
           " " + thing.many + ".";
  }

  void dialogue(std::string& out) {
    const Name& a = rng_.pick(kNames);
    const Name* b = &rng_.pick(kNames);
    while (b == &a) b = &rng_.pick(kNames);
    switch (rng_.below(3)) {
      case 0: {
        const Noun& thing = noun();
        const std::string where = place();
        out += "\"Where is the " + std::string(thing.one) + "?\" asked " + a.name + ".\n\"The " + thing.one + " is " +
               where + ",\" said " + b->name + ".";
        break;
      }
      case 1: {
        const int x = rng_.range(0, 30), y = rng_.range(0, 30);
        out += "\"What is " + std::to_string(x) + " plus " + std::to_string(y) + "?\" asked " + a.name + ".\n\"" +
               std::to_string(x) + " plus " + std::to_string(y) + " is " + std::to_string(x + y) + ",\" said " +
               b->name + ".";
        break;
      }
      default: {
        const int i = rng_.below(static_cast<int>(kNouns.size()));
        out += "\"What color is the " + std::string(kNouns[i].one) + "?\" asked " + a.name + ".\n\"The " +
               kNouns[i].one + " is " + kColors[color_of_[i]] + ",\" said " + b->name + ".";
      }
    }
  }

  void paragraph(std::string& out) {
    const int sentences = rng_.range(3, 7);
    for (int i = 0; i < sentences; ++i) {
      if (i > 0 && out.back() != '\n') out += ' ';
      const int kind = rng_.below(100);
      if (kind < 35) {
        narrative(out);
      } else if (kind < 47) {
        present(out);
      } else if (kind < 57) {
        description(out);
      } else if (kind < 66) {
        fact(out);
      } else if (kind < 78) {
        arithmetic(out);
      } else if (kind < 88) {
        counting(out);
      } else {
        if (i > 0) out.back() = '\n';  // dialogues sit on their own lines
        dialogue(out);
        if (i + 1 < sentences) out += '\n';
      }
    }
  }

  Rng rng_;
  std::array<int, kNouns.size()> color_of_{};
};

}  // namespace

std::string_view embedded_corpus() {
  static const std::string corpus = Generator().run();  // thread-safe one-time initialisation
  return corpus;
}

}  // namespace zt
