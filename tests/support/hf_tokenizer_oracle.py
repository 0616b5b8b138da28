#!/usr/bin/env python3
"""Trains small tokenizers with Hugging Face `tokenizers` and writes what it encodes and decodes.

The reference for tests/hf_tokenizer_test.cpp and bench/tokenizer_bench.sh: nothing is
downloaded; every tokenizer is trained here on generated text.

  hf_tokenizer_oracle.py cases OUT_DIR [LINES [KIND...]]
      For each kind, all when none is named (bytelevel: GPT-2's layout; bytelevel_prefix: the
      same with add_prefix_space; llama3: Llama 3's split regex and template, ignore_merges;
      sentencepiece: Llama 2's layout with byte fallback; sentencepiece_unk: the same without
      byte fallback, unknown characters fused; metaspace: byte fallback with a Metaspace
      pre-tokenizer and decoder, "first" prepend scheme), writes OUT_DIR/<kind>.json (the
      tokenizer) and OUT_DIR/<kind>_cases.json: {"texts": [...], "ids": [...], "ids_with_special": [...],
      "decoded": [...], "decoded_skipping_special": [...]} for LINES test texts (default 3000).
  hf_tokenizer_oracle.py text OUT_FILE LINES
      Writes LINES generated texts (the kind the cases use, newlines inside them too) joined by
      newlines: the benchmark's mixed text.
  hf_tokenizer_oracle.py encode TOKENIZER_JSON TEXT_FILE OUT_JSON
      Encodes the whole text of TEXT_FILE at once, without special tokens; writes the ids
      run-length encoded (long texts repeat them): {"runs": [[id, count], ...]}.
  hf_tokenizer_oracle.py bench TOKENIZER_JSON TEXT_FILE REPEATS
      Encodes the lines of TEXT_FILE with encode_batch, REPEATS times, on the threads that
      RAYON_NUM_THREADS allows; prints {"seconds": best, "bytes": ..., "tokens": ...}.
"""
import json
import random
import sys
import time

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")

WORDS = ("the of and to in is was for that with as on by at from it he she they we you this are be his her "
         "model token train data layer weight gradient memory shard stage optimizer batch step loss value "
         "running quickly believe strangely fine-tune re-enter e-mail well-known").split()
CONTRACTIONS = ["I'm", "don't", "DON'T", "we've", "WE'VE", "you'll", "YOU'LL", "he's", "HE'S", "she'd", "SHE'D",
                "they're", "THEY'RE", "it'S", "can't", "o'clock", "rock'n'roll"]
ACCENTED = ["café", "naïve", "Ærøskøbing", "façade", "Zürich", "niño", "crème brûlée", "Ελληνικά", "Москва",
            "İstanbul", "ǅemal", "Straße"]
CJK = ["東京都", "中文字符", "日本語のテキスト", "한국어", "漢字かな交じり文", "北京"]
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧", "🚀🚀", "❤️", "🇫🇷", "∑", "√2", "→", "€", "½", "²"]
# Whitespace the two regex engines must agree on: Unicode White_Space and a few look-alikes that
# are not (U+180E, U+200B, U+FEFF).
SPACES = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n", "\u00a0", "\u3000", "\u2003", "\u0085",
          "\u2028", "\u180e", "\u200b", "\ufeff", "\u000b", "\u000c"]
PUNCTUATION = [".", ",", "!", "?", "...", ";", ":", "(", ")", "\"", "'", "-", "--", "#", "$", "%", "&", "@", "<", ">",
               "/", "\\", "[", "]", "{", "}", "__", "=="]


def number(rng):
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 12)))


def word(rng, specials):
    """A word of the test texts; `specials` are the added tokens to write into them."""
    r = rng.random()
    if r < 0.45:
        w = rng.choice(WORDS)
        return w.capitalize() if rng.random() < 0.2 else (w.upper() if rng.random() < 0.05 else w)
    for limit, pool in ((0.55, CONTRACTIONS), (0.63, ACCENTED), (0.69, CJK), (0.74, EMOJI), (0.82, PUNCTUATION)):
        if r < limit:
            return rng.choice(pool)
    if r < 0.92:
        return number(rng)
    if r < 0.94 and specials:
        return rng.choice(specials)
    return rng.choice(WORDS) + rng.choice(PUNCTUATION)


def text_line(rng, specials):
    parts = []
    for _ in range(rng.randint(1, 24)):
        parts.append(word(rng, specials))
        parts.append(rng.choice(SPACES) if rng.random() < 0.25 else " ")
    line = "".join(parts)
    if rng.random() < 0.2:
        line = rng.choice(SPACES) + line  # leading whitespace
    if rng.random() < 0.5:
        line = line.rstrip(" ")
    return line


def corpus(seed, lines, specials):
    rng = random.Random(seed)
    return [text_line(rng, specials) for _ in range(lines)]


def byte_level(add_prefix_space):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(1, 20000, []), trainer)
    tok.add_tokens([AddedToken("model weight", normalized=True)])  # an added token that is not special
    return tok, ["<|endoftext|>", "<|pad|>", "model weight"]


def llama3():
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(vocab_size=1500, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(2, 20000, []), trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    return tok, specials


def sentencepiece(byte_fallback, metaspace=False):
    """Llama 2's layout: Prepend + Replace normalizer, no pre-tokenizer, <0xNN> byte tokens at ids 3-258.
    With `metaspace`, the later layout: a Metaspace pre-tokenizer that prepends to the text's
    first stretch only, and the Metaspace decoder."""
    specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=specials, limit_alphabet=120, show_progress=False)
    tok.train_from_iterator(corpus(3, 20000, []), trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    ordered = sorted(vocab.items(), key=lambda kv: kv[1])
    rebuilt = {t: i for i, (t, _) in enumerate(ordered[:3])}
    for b in range(256):
        rebuilt[f"<0x{b:02X}>"] = len(rebuilt)
    for t, _ in ordered[3:]:
        rebuilt[t] = len(rebuilt)
    spec["model"]["vocab"] = rebuilt
    spec["model"]["byte_fallback"] = byte_fallback
    spec["pre_tokenizer"] = None
    spec["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"}, {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    if metaspace:
        spec["normalizer"] = None
        spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True}
        spec["decoder"] = {"type": "Sequence", "decoders": [
            {"type": "ByteFallback"}, {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True}]}
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return tok, specials


def kinds():
    yield "bytelevel", lambda: byte_level(False)
    yield "bytelevel_prefix", lambda: byte_level(True)
    yield "llama3", llama3
    yield "sentencepiece", lambda: sentencepiece(True)
    yield "sentencepiece_unk", lambda: sentencepiece(False)
    yield "metaspace", lambda: sentencepiece(True, metaspace=True)


def write_cases(out_dir, lines, wanted):
    for seed, (name, build) in enumerate(kinds()):
        if wanted and name not in wanted:
            continue
        tok, specials = build()
        tok.save(f"{out_dir}/{name}.json")
        texts = corpus(100 + seed, lines, specials) + ["", " ", "\n", specials[0], specials[-1] + specials[0]]
        plain = tok.encode_batch(texts, add_special_tokens=False)
        special = tok.encode_batch(texts, add_special_tokens=True)
        ids = [e.ids for e in plain]
        cases = {"texts": texts, "ids": ids, "ids_with_special": [e.ids for e in special],
                 "decoded": tok.decode_batch(ids, skip_special_tokens=False),
                 "decoded_skipping_special": tok.decode_batch(ids, skip_special_tokens=True)}
        with open(f"{out_dir}/{name}_cases.json", "w", encoding="utf-8") as f:
            json.dump(cases, f, ensure_ascii=False)


def encode(tokenizer_json, text_file, out_json):
    tok = Tokenizer.from_file(tokenizer_json)
    with open(text_file, encoding="utf-8", newline="") as f:
        text = f.read()
    runs = []
    for i in tok.encode(text, add_special_tokens=False).ids:
        if runs and runs[-1][0] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    with open(out_json, "w", encoding="utf-8") as f:
        json.dump({"runs": runs}, f)


def bench(tokenizer_json, text_file, repeats):
    tok = Tokenizer.from_file(tokenizer_json)
    with open(text_file, encoding="utf-8", newline="") as f:  # no newline translation: the same lines as C++
        lines = f.read().split("\n")
    best, tokens = float("inf"), 0
    for _ in range(repeats):
        start = time.perf_counter()
        encodings = tok.encode_batch(lines, add_special_tokens=False)
        best = min(best, time.perf_counter() - start)
        tokens = sum(len(e.ids) for e in encodings)
    print(json.dumps({"seconds": best, "bytes": sum(len(l.encode()) for l in lines), "tokens": tokens}))


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "cases":
        write_cases(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 3000, set(sys.argv[4:]))
    elif len(sys.argv) == 4 and sys.argv[1] == "text":
        with open(sys.argv[2], "w", encoding="utf-8", newline="") as f:
            f.write("\n".join(corpus(7, int(sys.argv[3]), [])))
    elif len(sys.argv) == 5 and sys.argv[1] == "encode":
        encode(sys.argv[2], sys.argv[3], sys.argv[4])
    elif len(sys.argv) == 5 and sys.argv[1] == "bench":
        bench(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit(__doc__)
