# Oracle for data_chat_jsonl_test: ChatGLM2's fine-tuning preprocessing (build_prompt, then
# input_ids = a + b + [eos], labels = [-100]*len(a) + b + [eos], padded) with a byte tokenizer
# (bytes 0..255, bos 256, eos 257, pad 258), shifted to (tokens, targets).
# usage: chatglm_preprocess.py <jsonl> <max_source_length> <max_target_length>
# prints, per record, a line of tokens and a line of targets.
import json
import sys

path, ms, mt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
BOS, EOS, PAD = 256, 257, 258
for line in open(path, encoding="utf-8"):
    if not line.strip():
        continue
    ex = json.loads(line)
    prompt = ""
    history = ex.get("history") or []
    for i, (q, r) in enumerate(history):
        prompt += "[Round {}]\n\n问：{}\n\n答：{}\n\n".format(i + 1, q, r)
    prompt += "[Round {}]\n\n问：{}\n\n答：".format(len(history) + 1, ex["prompt"])
    a = ([BOS] + list(prompt.encode("utf-8")))[:ms]
    b = list(ex["response"].encode("utf-8"))[:mt]
    ids = a + b + [EOS]
    labels = [-100] * len(a) + b + [EOS]
    n = ms + mt + 1
    ids += [PAD] * (n - len(ids))
    labels += [-100] * (n - len(labels))
    print(" ".join(map(str, ids[:-1])))
    print(" ".join(map(str, labels[1:])))
