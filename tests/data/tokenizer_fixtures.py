# Fixtures and oracles for data_sentencepiece_test and data_chat_template_test (run by CTest
# as the fixture `tokenizer_fixtures`, with Debian's /usr/bin/python3 and python3-sentencepiece).
#
# usage: tokenizer_fixtures.py <out_dir> <seed_chat_jsonl>
#
# Writes into out_dir:
#   corpus.txt                   generated English + Chinese + emoji text
#   tiny.model                   a 120-piece English model for the programs' --random models
#   unigram.model, bpe.model     spm_train on it (unigram, NFKC, without byte fallback: rare
#                                characters become <unk>; BPE as LLaMA's and ChatGLM's: byte
#                                fallback, digits split, no normalization, whitespace kept)
#   cases_<model>.tsv            per line: hex(input bytes) TAB ids TAB hex(decoded text) TAB
#                                1 when no id is <unk> (streaming decode must then match)
#   specials_<model>.tsv         per line: name TAB id for ChatGLM3's appended special tokens,
#                                computed by ChatGLM's rule (piece_size + position), and the
#                                model's own <unk> <s> </s>
#   records.jsonl                chat records: the seed's, then generated ones with history
#   chat_<template>.txt          per (record, max_source, max_target): a header line
#                                "record ms mt", a line of ids, a line of 0/1 response flags
#   conversations.jsonl          {"messages": [{"role", "content", "metadata"?}, ...]}: the
#                                records as messages (some with a system message), and ChatGLM3
#                                tool calls with observations
#   render_<template>.txt        per conversation, the prompt ids (up to where the assistant's
#                                answer begins), or "refused" where the template has no place
#                                for a message's role
#   api_<template>.txt           per record, the prompt ids of api.py's {prompt, history}
#   stop_<template>.txt          the ids that end an answer (eos; ChatGLM3's <|user|> and
#                                <|observation|>)
#
# The chat templates below are transcribed independently from ChatGLM2's build_prompt and
# ptuning/main.py preprocessing, ChatGLM3's build_single_message / build_chat_input, and
# Meta's LLaMA-2 chat_completion format; loom's C++ (data/chat_template.hpp) must agree.
import json
import os
import random
import subprocess
import sys

import sentencepiece as spm

out, seed_jsonl = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
rng = random.Random(20240518)

EN = ("the quick brown fox jumps over lazy dog river garden teacher farmer happy small old red "
      "quiet bright tall green cold busy model token train serve batch").split()
ZH_COMMON = "的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产种面而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当使点从业本去把性好应开它合还因由其些然前外天政四日那社义事平形相全表间样与关各重新线内数正心反你明看原又么利比或但质气第向道命此变条只没结解问意建月公无系军很情者最立代想已通并提直题党程展五果料象员革位入常文总次品式活设及管特件长求老头基资边流路级少图山统接知较将组见计别她手角期根论运农指几九区强放决西被干做必战先回则任取据处队南给色光门即保治北造百规热领七海口东导器压志世金增争济阶油思术极交受联什认六共权收证改清己美再采转更单风切打白教速花带安场身车例真务具万每目至达走积示议声报斗完类八离华名确才科张信马节话米整空元况今集温传土许步群广石记需段研界拉林律叫且究观越织装影算低持音众书布复容儿须际商非验连断深难近矿千周委素技备半办青省列习响约支般史感劳便团往酸历市克何除消构府称太准精值号率族维划选标写存候毛亲快效斯院查江型眼王按格养易置派层片始却专状育厂京识适属圆包火住调满县局照参红细引听该铁价严"
ZH_RARE = "龘齉爨癵驫麤鱻灥靐"
EMOJI = ["\U0001F600", "\U0001F680", "\U0001F44D\U0001F3FD", "\u2764\ufe0f", "\U0001F1E8\U0001F1F3", "\U0001F469\u200d\U0001F4BB"]
PUNCT = list(".,!?;:'\"()[]{}-_/\\@#$%^&*+=<>|~`") + ["，", "。", "！", "？", "：", "“", "”", "、"]


def zh(n, rare=False):
    s = "".join(rng.choice(ZH_COMMON) for _ in range(n))
    if rare:
        s += rng.choice(ZH_RARE)
    return s


def sentence():
    parts = []
    for _ in range(rng.randint(1, 8)):
        k = rng.random()
        if k < 0.45:
            parts.append(rng.choice(EN))
        elif k < 0.8:
            parts.append(zh(rng.randint(1, 6)))
        elif k < 0.88:
            parts.append(rng.choice(EMOJI))
        elif k < 0.95:
            parts.append(str(rng.randint(0, 99999)))
        else:
            parts.append(rng.choice(PUNCT))
    return " ".join(parts)


# ---- corpus and models ---------------------------------------------------------------------
corpus = os.path.join(out, "corpus.txt")
with open(corpus, "w", encoding="utf-8") as f:
    for _ in range(6000):
        f.write(sentence() + "\n")
common = ["--input=" + corpus, "--num_threads=1", "--minloglevel=2", "--character_coverage=0.995",
          "--input_sentence_size=0", "--seed_sentencepiece_size=50000"]
models = {
    "unigram": common + ["--model_type=unigram", "--vocab_size=700"],
    "bpe": common + ["--model_type=bpe", "--vocab_size=1400", "--byte_fallback=true", "--split_digits=true",
                   "--normalization_rule_name=identity", "--remove_extra_whitespaces=false"],
}
# tiny.model: English only, small enough for llama-generate --random (vocab 256)
tiny_corpus = os.path.join(out, "tiny_corpus.txt")
with open(tiny_corpus, "w") as f:
    for _ in range(2000):
        f.write(" ".join(rng.choice(EN) for _ in range(rng.randint(3, 12))) + "\n")
subprocess.run(["spm_train", "--model_prefix=" + os.path.join(out, "tiny"), "--input=" + tiny_corpus, "--vocab_size=120",
                "--model_type=bpe", "--byte_fallback=false", "--num_threads=1", "--minloglevel=2"], check=True,
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
for name, args in models.items():
    subprocess.run(["spm_train", "--model_prefix=" + os.path.join(out, name)] + args, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

# ---- encode / decode cases -----------------------------------------------------------------
def case_bytes(i):
    k = i % 10
    if k < 5:
        return sentence().encode("utf-8")
    if k == 5:  # rare Chinese: <unk> without byte fallback, bytes with it
        return (zh(rng.randint(0, 4), rare=True) + " " + rng.choice(EMOJI)).encode("utf-8")
    if k == 6:  # whitespace runs, tabs, newlines, leading and trailing spaces
        ws = ["", " ", "  ", "\t", "\n", " \n ", "   "]
        return (rng.choice(ws) + sentence() + rng.choice(ws) + sentence() + rng.choice(ws)).encode("utf-8")
    if k == 7:  # invalid UTF-8: stray continuation bytes, cut sequences, overlongs, random bytes
        s = bytearray(sentence().encode("utf-8"))
        bad = [b"\x80", b"\xbf", b"\xc3", b"\xe4\xb8", b"\xf0\x9f\x98", b"\xc0\xaf", b"\xff", b"\xfe", b"\xed\xa0\x80"]
        for _ in range(rng.randint(1, 3)):
            p = rng.randint(0, len(s))
            s[p:p] = rng.choice(bad)
        return bytes(s)
    if k == 8:
        return bytes(rng.randint(0, 255) for _ in range(rng.randint(0, 24)))
    return ("".join(rng.choice(EMOJI) for _ in range(rng.randint(1, 4))) + rng.choice(["", " ", "x"])).encode("utf-8")


CHATGLM3_SPECIALS = ["[MASK]", "[gMASK]", "[sMASK]", "sop", "eop", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
for name in models:
    sp = spm.SentencePieceProcessor(model_file=os.path.join(out, name + ".model"))
    with open(os.path.join(out, "cases_" + name + ".tsv"), "w") as f:
        for i in range(10000):
            b = case_bytes(i)
            ids = sp.encode(b)  # bytes, as the C++ side sees them (invalid UTF-8 included)
            text = sp.decode(ids)
            stream_ok = int(sp.unk_id() not in ids)
            f.write("%s\t%s\t%s\t%d\n" % (b.hex(), " ".join(map(str, ids)), text.encode("utf-8").hex(), stream_ok))
    with open(os.path.join(out, "specials_" + name + ".tsv"), "w") as f:
        n = sp.get_piece_size()  # ChatGLM: special tokens take ids n, n + 1, ... in order
        for k, t in enumerate(CHATGLM3_SPECIALS):
            f.write("%s\t%d\n" % (t, n + k))
        f.write("<unk>\t%d\n<s>\t%d\n</s>\t%d\n" % (sp.unk_id(), sp.bos_id(), sp.eos_id()))

# ---- chat records ----------------------------------------------------------------------------
records = [json.loads(l) for l in open(seed_jsonl, encoding="utf-8") if l.strip()]
for i in range(40):
    hist = [[sentence(), sentence()] for _ in range(rng.randint(0, 3))]
    if i % 7 == 3 and hist:
        hist[0][0] = ""
    prompt = rng.choice(["", "  "]) + sentence() + rng.choice(["", " ", "\n"])
    records.append({"prompt": prompt, "response": rng.choice(["", " "]) + sentence(), "history": hist})
with open(os.path.join(out, "records.jsonl"), "w", encoding="utf-8") as f:
    for r in records:
        f.write(json.dumps(r, ensure_ascii=False) + "\n")

SYSTEM = "You are a helpful assistant. 请用中文回答。"
sp = spm.SentencePieceProcessor(model_file=os.path.join(out, "bpe.model"))
N = sp.get_piece_size()
special = {t: N + k for k, t in enumerate(CHATGLM3_SPECIALS)}
enc = lambda s: sp.encode(s)


def chatglm2(r):
    # tokenization_chatglm.py build_prompt; ptuning/main.py: a = [gMASK, sop] + encode(prompt)
    prompt = ""
    for i, (q, a) in enumerate(r["history"]):
        prompt += "[Round {}]\n\n问：{}\n\n答：{}\n\n".format(i + 1, q, a)
    prompt += "[Round {}]\n\n问：{}\n\n答：".format(len(r["history"]) + 1, r["prompt"])
    return [special["[gMASK]"], special["sop"]] + enc(prompt), enc(r["response"])


def chatglm3(r):
    def message(role, content):  # build_single_message(role, "", content)
        return [special["<|" + role + "|>"]] + enc("\n") + enc(content)
    ids = [special["[gMASK]"], special["sop"]] + message("system", SYSTEM)
    for q, a in r["history"]:
        ids += message("user", q) + message("assistant", a)
    ids += message("user", r["prompt"]) + [special["<|assistant|>"]]
    return ids, enc("\n") + enc(r["response"])  # what the model writes after <|assistant|>


def llama2(r):
    # Meta's chat_completion: the system prompt wraps the first user message
    turns = [[q, a] for q, a in r["history"]] + [[r["prompt"], None]]
    turns[0][0] = "<<SYS>>\n" + SYSTEM + "\n<</SYS>>\n\n" + turns[0][0]
    ids = []
    for q, a in turns[:-1]:
        ids += [sp.bos_id()] + enc("[INST] {} [/INST] {} ".format(q.strip(), a.strip())) + [sp.eos_id()]
    ids += [sp.bos_id()] + enc("[INST] {} [/INST]".format(turns[-1][0].strip()))
    return ids, enc(r["response"].strip())


for name, fn in {"chatglm2": chatglm2, "chatglm3": chatglm3, "llama2": llama2}.items():
    with open(os.path.join(out, "chat_" + name + ".txt"), "w") as f:
        for k, r in enumerate(records):
            source, target = fn(r)
            for ms, mt in [(4096, 4096), (64, 64), (16, 8), (3, 1), (1, 40)]:
                # ptuning/main.py: a truncated to max_source_length (its tail is cut, the prefix
                # kept), b to max_target_length; input = a + b + [eos]; loss on b and eos
                a, b = source[:ms], target[:mt]
                ids = a + b + [sp.eos_id()]
                mask = [0] * len(a) + [1] * (len(b) + 1)
                f.write("%d %d %d\n%s\n%s\n" % (k, ms, mt, " ".join(map(str, ids)), " ".join(map(str, mask))))


# ---- conversations as messages (what a server reads) -------------------------------------------
def turns(r):
    m = []
    for q, a in r["history"]:
        m += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return m + [{"role": "user", "content": r["prompt"]}]


TOOLS = [{"name": "get_weather", "description": "天气 of a city", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "description": "城市"}}, "required": ["city"]}}]
conversations = []
for k, r in enumerate(records):
    conversations.append(([{"role": "system", "content": SYSTEM}] if k % 2 == 0 else []) + turns(r))
# ChatGLM3's tool use: the system message carries the tools (content + "\n" + json.dumps(tools,
# indent=4, ensure_ascii=False), as build_chat_input folds them); the assistant's call has the
# tool's name as metadata; the tool's result comes back as an observation.
tool_system = {"role": "system", "content": "Answer the following questions as best as you can. You have access to the "
               "following tools:\n" + json.dumps(TOOLS, indent=4, ensure_ascii=False)}
call = {"role": "assistant", "metadata": "get_weather", "content": "```python\ntool_call(city='北京')\n```"}
observation = {"role": "observation", "content": json.dumps({"city": "北京", "temperature": 21}, ensure_ascii=False)}
conversations.append([tool_system, {"role": "user", "content": "北京 weather?"}, call, observation])
conversations.append([tool_system, {"role": "user", "content": "北京 weather?"}, call, observation,
                      {"role": "assistant", "content": "It is 21 degrees in 北京."}, {"role": "user", "content": " and tomorrow? "}])
conversations.append([{"role": "system", "content": ""}, {"role": "user", "content": "  hi "}])  # Meta wraps an empty system too
conversations.append([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])        # not alternating
with open(os.path.join(out, "conversations.jsonl"), "w", encoding="utf-8") as f:
    for c in conversations:
        f.write(json.dumps({"messages": c}, ensure_ascii=False) + "\n")


def alternating(msgs):  # user, assistant, ..., user
    return len(msgs) % 2 == 1 and all(m["role"] == ("user" if i % 2 == 0 else "assistant") for i, m in enumerate(msgs))


def render_chatglm2(msgs):  # build_prompt over the [query, response] pairs; no system, no tools
    if not alternating(msgs) or any(m.get("metadata") for m in msgs):
        return None
    return chatglm2({"history": [[msgs[i]["content"], msgs[i + 1]["content"]] for i in range(0, len(msgs) - 1, 2)],
                     "prompt": msgs[-1]["content"], "response": ""})[0]


def render_chatglm3(msgs):  # build_chat_input: build_single_message(role, metadata, content) each, then <|assistant|>
    ids = [special["[gMASK]"], special["sop"]]
    for m in msgs:
        ids += [special["<|" + m["role"] + "|>"]] + enc(m.get("metadata", "") + "\n") + enc(m["content"])
    return ids + [special["<|assistant|>"]]


def render_llama2(msgs):  # Meta's chat_completion
    msgs = [dict(m) for m in msgs]
    if msgs and msgs[0]["role"] == "system":
        msgs = [{"role": "user", "content": "<<SYS>>\n" + msgs[0]["content"] + "\n<</SYS>>\n\n" + msgs[1]["content"]}] + msgs[2:]
    if not alternating(msgs):
        return None
    ids = []
    for q, a in zip(msgs[0:-1:2], msgs[1::2]):
        ids += [sp.bos_id()] + enc("[INST] {} [/INST] {} ".format(q["content"].strip(), a["content"].strip())) + [sp.eos_id()]
    return ids + [sp.bos_id()] + enc("[INST] {} [/INST]".format(msgs[-1]["content"].strip()))


renders = {"chatglm2": render_chatglm2, "chatglm3": render_chatglm3, "llama2": render_llama2}
stops = {"chatglm2": [sp.eos_id()], "chatglm3": [sp.eos_id(), special["<|user|>"], special["<|observation|>"]],
         "llama2": [sp.eos_id()]}
for name, fn in renders.items():
    with open(os.path.join(out, "render_" + name + ".txt"), "w") as f:
        for c in conversations:
            ids = fn(c)
            f.write(("refused" if ids is None else " ".join(map(str, ids))) + "\n")
    with open(os.path.join(out, "api_" + name + ".txt"), "w") as f:
        for r in records:  # api.py: {"prompt", "history": [[q, a], ...]}, no system prompt
            f.write(" ".join(map(str, fn(turns(r)))) + "\n")
    with open(os.path.join(out, "stop_" + name + ".txt"), "w") as f:
        f.write(" ".join(map(str, stops[name])) + "\n")
