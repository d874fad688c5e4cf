#!/usr/bin/env bash
# README command (3): the seed's whole story on a small ChatGLM3-shaped model, on this machine:
#   0. a "pretrained" ChatGLM3 Hugging Face folder to start from (no network here, so it is made
#      first: a SentencePiece tokenizer trained with spm_train, a small ChatGLM3 pretrained by
#      llama-train on text and exported with --export-hf, tokenizer.model copied beside it);
#   1. chat fine-tuning from that folder (--init-from) on prompt/response/history records in the
#      seed's format, rendered by the ChatGLM3 template (loss on responses only), with the
#      seed's own ds_config_zero3.json (ZeRO-3, fp16 with the dynamic loss scaler, offload,
#      activation checkpointing) on 2 data-parallel thread ranks;
#   2. export of the fine-tuned model as an HF ChatGLM folder (the tokenizer copied beside it,
#      and a tokenizer_config.json naming the ChatGLM3 template and its special tokens);
#   3. llama-serve on that folder (it derives the chatglm3 template from the folder), and a curl
#      of ChatGLM's api.py protocol that gets a response.
# Usage: bash scripts/seed-story.sh [OUT_DIR]   (default seed-story-out; runs in a few minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-seed-story-out}")
port=${SEED_STORY_PORT:-18431}
bash scripts/install-deps.sh
bash scripts/configure.sh
cmake --build build --target llama-train llama-serve loom-make-corpus
export OPENBLAS_NUM_THREADS=1
bin=build/examples
rm -rf "$out" && mkdir -p "$out"

echo "== chat records in the seed's format (prompt with the customer's fields, response, history)"
names=(张三 李四 王五 赵六 陈七 刘八 杨九 黄十)
provinces=(湖北 湖南 广东 浙江 江苏 四川 山东 河南)
for i in $(seq 0 63); do
  n=${names[$((i % 8))]} p=${provinces[$(((i / 8) % 8))]} age=$((25 + (i * 7) % 40))
  sex=$([ $((i % 2)) = 0 ] && echo 男士 || echo 女士)
  printf '{"prompt": "什么事。\\n[姓名]：%s\\n[年龄]：%s.0\\n[性别]：%s\\n[省份]：%s", "response": "打扰您了，给您介绍下%s近期的优惠活动？", "history": [["", "您好，请问是%s吗？"], ["是。", "喂，您好，我这是您专属客服顾问。"]]}\n' \
    "$n" "$age" "$sex" "$p" "$p" "$n"
done > "$out/train.jsonl"
cp ../shared/seed-data/ds_config_zero3.json "$out/ds_config.json" 2>/dev/null || cp tests/io/config/ds_config_zero3.json "$out/ds_config.json"

echo "== 0. a pretrained ChatGLM3 to start from: tokenizer, pretraining, HF export"
"$bin/data/loom-make-corpus" "$out/text" --bytes 300000 --text >/dev/null
sed -e 's/\\n/\n/g' -e 's/[{}"]//g' "$out/train.jsonl" >> "$out/text.txt"
spm_train --input="$out/text.txt" --model_prefix="$out/tokenizer" --vocab_size=600 --character_coverage=1.0 \
  --model_type=bpe --byte_fallback=true --minloglevel=2
"$bin/data/loom-make-corpus" "$out/pretrain" --input "$out/text.txt" --tokenizer "$out/tokenizer.model"
model=(--arch chatglm --dim 64 --n-layers 2 --n-heads 4 --n-kv-heads 2 --hidden-dim 176 --vocab 640 --seq-len 128)
"$bin/llama/train/llama-train" "${model[@]}" --data "$out/pretrain.bin" --steps 60 --batch 8 --lr 3e-3 --print-every 20 \
  --save "$out/pretrain-ckpt" --export-hf "$out/chatglm3-base"
cp "$out/tokenizer.model" "$out/chatglm3-base/tokenizer.model"

echo "== 1. chat fine-tuning from the HF folder with the seed's ds_config (ZeRO-3, fp16, 2 ranks)"
"$bin/llama/train/llama-train" --init-from "$out/chatglm3-base" --dp 2 --config "$out/ds_config.json" \
  --data "$out/train.jsonl" --tokenizer "$out/chatglm3-base/tokenizer.model" --template chatglm3 --seq-len 128 --steps 30 --print-every 5 \
  --save "$out/finetune-ckpt" --export-hf "$out/chatglm3-finetuned"

echo "== 2-3. serve the exported folder (api.py protocol) and ask it"
"$bin/llama/serve/llama-serve" --checkpoint "$out/chatglm3-finetuned" --tokenizer "$out/chatglm3-finetuned/tokenizer.model" \
  --port "$port" > "$out/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
request='{"prompt": "什么事。\n[姓名]：张三\n[年龄]：45.0\n[性别]：男士\n[省份]：湖北", "history": [["", "您好，请问是张三吗？"], ["是。", "喂，您好，我这是您专属客服顾问。"]]}'
echo "curl -X POST http://127.0.0.1:$port/ -d '$request'"
curl -sf -X POST "http://127.0.0.1:$port/" -H 'Content-Type: application/json' -d "$request"
echo
