# Oracle for make_corpus_chat_shard: loom-make-corpus's token shard and loss-mask shard must
# hold, record after record, the ids and flags tokenizer_fixtures.py's Python transcription of
# the template gives at the same truncation.
# usage: check_corpus.py <prefix> <chat_template.txt> <max_source> <max_target>
import struct
import sys

prefix, expected, ms, mt = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])


def shard(path):
    b = open(path, "rb").read()
    magic, header, width, n, vocab = struct.unpack_from("<8sIIQI", b, 0)
    assert magic == b"LOOMTOK1" and header == 64, path
    assert len(b) == 64 + n * width, path
    return list(struct.unpack_from("<%d%s" % (n, "H" if width == 2 else "I"), b, 64)), vocab


ids, vocab = shard(prefix + ".bin")
mask, _ = shard(prefix + ".mask.bin")
want_ids, want_mask = [], []
lines = open(expected).read().split("\n")
for i in range(0, len(lines) - 2, 3):
    _, s, t = map(int, lines[i].split())
    if (s, t) == (ms, mt):
        want_ids += list(map(int, lines[i + 1].split()))
        want_mask += list(map(int, lines[i + 2].split()))
assert want_ids, "no expected records at that truncation"
assert ids == want_ids, "token shard differs from the Python transcription"
assert mask == want_mask, "mask shard differs from the Python transcription"
assert max(ids) < vocab
print("ok: %d tokens, %d records' worth, vocab %d" % (len(ids), len(lines) // 15, vocab))
