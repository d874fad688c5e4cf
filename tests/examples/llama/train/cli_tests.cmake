# llama-train's command-line tests (loom_example_tests: run in examples/llama/train's scope).
# The CLI's contract: --help, a 2x2x2 run prints the mesh, every rank's memory and progress,
# and a mesh the model cannot be split over is refused naming the value.
set(_small --dim 32 --n-layers 2 --seq 16 --batch 2 --micro-batches 2 --steps 2 --data counting)
add_test(NAME llama_train_cli_help COMMAND llama-train --help)
add_test(NAME llama_train_cli_222 COMMAND llama-train --dp 2 --tp 2 --pp 2 --schedule 1f1b ${_small})
add_test(NAME llama_train_cli_heads COMMAND llama-train --dp 1 --tp 3 --pp 1 ${_small})
add_test(NAME llama_train_cli_layers COMMAND llama-train --dp 1 --tp 1 --pp 3 ${_small})
# held-out evaluation under ZeRO-3 on (2,2,2): loss and perplexity after every step
add_test(NAME llama_train_cli_eval COMMAND llama-train --dp 2 --tp 2 --pp 2 --zero 3 --eval-every 1 ${_small})
set_tests_properties(llama_train_cli_eval PROPERTIES PASS_REGULAR_EXPRESSION
                     "step 2/2 \\| loss.*\neval after step 2: loss [0-9.]+  perplexity [0-9.]+" TIMEOUT 60)
# real data: the chat record of tests/data (byte tokens, loss on the response) on (2,1,2)
add_test(NAME llama_train_cli_chat_data COMMAND llama-train --dp 2 --tp 1 --pp 2 --batch 1 --vocab 260 --seq 32
                                                  --data ${PROJECT_SOURCE_DIR}/tests/data/chat_sample.jsonl ${_small})
set_tests_properties(llama_train_cli_chat_data PROPERTIES PASS_REGULAR_EXPRESSION "step 2/2 \\| loss" TIMEOUT 60)
# ChatGLM's max_source_length / max_target_length: rows of their sum; a source that fills
# the row is refused
add_test(NAME llama_train_cli_chat_lengths COMMAND llama-train --batch 1 --vocab 260 --max-source-length 40
                                                   --max-target-length 24 --data ${PROJECT_SOURCE_DIR}/tests/data/chat_sample.jsonl
                                                   --dim 32 --n-layers 2 --steps 1)
set_tests_properties(llama_train_cli_chat_lengths PROPERTIES PASS_REGULAR_EXPRESSION "micro-batches of \\[1, 64\\].*step 1/1 \\| loss"
                     TIMEOUT 60)
add_test(NAME llama_train_cli_chat_source_too_long COMMAND llama-train --seq-len 32 --max-source-length 32 --vocab 260
                                                          --data ${PROJECT_SOURCE_DIR}/tests/data/chat_sample.jsonl --steps 1)
set_tests_properties(llama_train_cli_chat_source_too_long PROPERTIES PASS_REGULAR_EXPRESSION
                     "--max-source-length 32 .*does not fit rows of --seq-len 32" TIMEOUT 30)
if(LOOM_HAS_MPI)  # the same binary under mpirun: 8 processes, one rank each
  add_test(NAME llama_train_cli_mpi_222 COMMAND ${MPIEXEC_EXECUTABLE} ${LOOM_MPIEXEC_FLAGS} -np 8
           $<TARGET_FILE:llama-train> --dp 2 --tp 2 --pp 2 --schedule 1f1b ${_small})
  set_tests_properties(llama_train_cli_mpi_222 PROPERTIES PASS_REGULAR_EXPRESSION
                       "mesh dp=2 x tp=2 x pp=2 \\(8 MPI ranks\\).*step 2/2 \\| loss" ENVIRONMENT OPENBLAS_NUM_THREADS=1
                       TIMEOUT 120 LABELS mpi)
  # Launch from a DeepSpeed-format hostfile (`host slots=N`), which Open MPI's --hostfile
  # reads as it is: 4 slots on localhost run 4 ranks without --oversubscribe, and a file
  # of 2 slots refuses them (so the file, not a flag, decides).
  file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/hostfile.slots4 "localhost slots=4\n")
  file(WRITE ${CMAKE_CURRENT_BINARY_DIR}/hostfile.slots2 "localhost slots=2\n")
  set(_hostfile_flags ${LOOM_MPIEXEC_FLAGS})
  list(REMOVE_ITEM _hostfile_flags --oversubscribe)
  foreach(_slots 4 2)
    add_test(NAME llama_train_cli_mpi_hostfile${_slots}
             COMMAND ${MPIEXEC_EXECUTABLE} ${_hostfile_flags} --hostfile ${CMAKE_CURRENT_BINARY_DIR}/hostfile.slots${_slots}
                     -np 4 $<TARGET_FILE:llama-train> --dp 2 --tp 2 --pp 1 ${_small})
    set_tests_properties(llama_train_cli_mpi_hostfile${_slots} PROPERTIES ENVIRONMENT OPENBLAS_NUM_THREADS=1
                         TIMEOUT 120 LABELS mpi)
  endforeach()
  set_tests_properties(llama_train_cli_mpi_hostfile4 PROPERTIES PASS_REGULAR_EXPRESSION
                       "mesh dp=2 x tp=2 x pp=1 \\(4 MPI ranks\\).*step 2/2 \\| loss")
  set_tests_properties(llama_train_cli_mpi_hostfile2 PROPERTIES PASS_REGULAR_EXPRESSION "not enough slots")
  # Fault matrix (docs/reliability.md): rank 1 of a 2-stage pipeline fails at step 1
  # (LOOM_FAULT_INJECT, a test hook); the job must end within the timeout (3 s here), its
  # exit status non-zero, with the error a survivor (or the failed rank) printed.
  set(_fault_expect_throw "llama-train: error: injected fault \\(LOOM_FAULT_INJECT\\) on rank 1 at step 1")
  set(_fault_expect_return "llama-train: error: mpi_comm: rank 0 .*timed out after 3000 ms in .*rank 1")
  set(_fault_expect_stop "${_fault_expect_return}")
  set(_fault_expect_kill "process rank 1 .*exited on signal 9")
  foreach(_kind throw return stop kill)
    add_test(NAME llama_train_fault_mpi_${_kind}
             COMMAND bash ${PROJECT_SOURCE_DIR}/tests/comm/fault_run.sh 45 "${_fault_expect_${_kind}}" --
                     ${MPIEXEC_EXECUTABLE} ${LOOM_MPIEXEC_FLAGS} -np 2 $<TARGET_FILE:llama-train> --dp 1 --tp 1 --pp 2
                     ${_small} --steps 3)
    set_tests_properties(llama_train_fault_mpi_${_kind} PROPERTIES TIMEOUT 60 LABELS "mpi;fault" PROCESSORS 2
                         ENVIRONMENT "LOOM_FAULT_INJECT=1:1:${_kind};LOOM_COMM_TIMEOUT=3;OPENBLAS_NUM_THREADS=1")
  endforeach()
endif()
# The same on thread ranks (throw and return: stop and kill act on the whole process).
add_test(NAME llama_train_fault_thread_throw COMMAND llama-train --dp 1 --tp 1 --pp 2 ${_small} --steps 3)
set_tests_properties(llama_train_fault_thread_throw PROPERTIES WILL_FAIL TRUE TIMEOUT 30 LABELS fault
                     ENVIRONMENT "LOOM_FAULT_INJECT=1:1:throw;LOOM_COMM_TIMEOUT=3")
add_test(NAME llama_train_fault_thread_return COMMAND llama-train --dp 1 --tp 1 --pp 2 ${_small} --steps 3)
set_tests_properties(llama_train_fault_thread_return PROPERTIES TIMEOUT 30 LABELS fault
                     ENVIRONMENT "LOOM_FAULT_INJECT=1:1:return;LOOM_COMM_TIMEOUT=3"
                     PASS_REGULAR_EXPRESSION "error: thread_comm: .*rank 1 of the group returned from its function")
add_test(NAME llama_train_fault_bad_value COMMAND llama-train --dp 1 --tp 1 --pp 2 ${_small})
set_tests_properties(llama_train_fault_bad_value PROPERTIES TIMEOUT 30 LABELS fault ENVIRONMENT "LOOM_FAULT_INJECT=1:x:throw"
                     PASS_REGULAR_EXPRESSION "LOOM_FAULT_INJECT=\"1:x:throw\" is not")
# The seed's ds_config_zero3.json as handed over (fp16 with the dynamic scaler, ZeRO-3, both
# offloads, activation checkpointing): DeepSpeed's batch rule gives micro batches of
# 1024 / (8 x dp=2) = 64; fp16 parameters; the scale starts at 2^16.
add_test(NAME llama_train_cli_seed_config
         COMMAND llama-train --config ${PROJECT_SOURCE_DIR}/tests/io/config/ds_config_zero3.json --dp 2 --tp 1 --pp 1
                 --dim 32 --n-layers 2 --seq 16 --steps 2)
set_tests_properties(llama_train_cli_seed_config PROPERTIES PASS_REGULAR_EXPRESSION
                     "ZeRO-3, schedule 1f1b, m=8 micro-batches of \\[64, 16\\].*parameters float16 \\(offload to cpu.*step 2/2 \\| loss [0-9.]+ .*\\| scale 65536"
                     ENVIRONMENT OPENBLAS_NUM_THREADS=1 TIMEOUT 120)
# sharded checkpoint: saved on (2,1,2) ZeRO-3 after 2 steps, resumed on (1,2,1) ZeRO-1 for 2 more
set(_ckpt ${CMAKE_CURRENT_BINARY_DIR}/cli_checkpoint)
add_test(NAME llama_train_cli_save COMMAND llama-train --dp 2 --tp 1 --pp 2 --zero 3 --save ${_ckpt} ${_small})
add_test(NAME llama_train_cli_resume COMMAND llama-train --dp 1 --tp 2 --pp 1 --zero 1 --resume ${_ckpt} --dim 32
         --n-layers 2 --seq 16 --batch 2 --micro-batches 4 --steps 4 --data counting)
set_tests_properties(llama_train_cli_save PROPERTIES PASS_REGULAR_EXPRESSION "saved checkpoint [^\n]*cli_checkpoint/step-2"
                     FIXTURES_SETUP train3d_ckpt TIMEOUT 60)
set_tests_properties(llama_train_cli_resume PROPERTIES PASS_REGULAR_EXPRESSION
                     "resumed from [^\n]*step-2 at step 2.*step 4/4 \\| loss" FIXTURES_REQUIRED train3d_ckpt TIMEOUT 60)
# --export-hf: the saved checkpoint as an HF folder, which llama-generate then loads
set(_hf ${CMAKE_CURRENT_BINARY_DIR}/cli_export_hf)
add_test(NAME llama_train_cli_export_hf COMMAND llama-train --dp 2 --tp 1 --pp 1 --save ${_ckpt}-export --keep-last 1
         --export-hf ${_hf} ${_small})
set_tests_properties(llama_train_cli_export_hf PROPERTIES PASS_REGULAR_EXPRESSION "exported [^\n]*step-2 as the HF folder"
                     FIXTURES_SETUP train3d_hf ENVIRONMENT OPENBLAS_NUM_THREADS=1 TIMEOUT 60)
if(TARGET llama-generate)
  add_test(NAME llama_train_cli_export_hf_generate COMMAND llama-generate --checkpoint ${_hf} --prompt "1 5 7" --max-new 4)
  set_tests_properties(llama_train_cli_export_hf_generate PROPERTIES FIXTURES_REQUIRED train3d_hf TIMEOUT 60)
endif()
# --init-from: fine-tuning starts from that exported folder on (2,1,1) ZeRO-3 (the weights
# themselves are checked against PyTorch-written folders in test_init_hf)
add_test(NAME llama_train_cli_init_from COMMAND llama-train --init-from ${_hf} --dp 2 --zero 3 --seq 16 --batch 2 --steps 2
         --data counting)
set_tests_properties(llama_train_cli_init_from PROPERTIES PASS_REGULAR_EXPRESSION
                     "initialised from the Hugging Face folder [^\n]*cli_export_hf.*step 2/2 \\| loss"
                     FIXTURES_REQUIRED train3d_hf ENVIRONMENT OPENBLAS_NUM_THREADS=1 TIMEOUT 60)
add_test(NAME llama_train_cli_init_from_missing COMMAND llama-train --init-from ${_hf}-missing --steps 1)
set_tests_properties(llama_train_cli_init_from_missing PROPERTIES PASS_REGULAR_EXPRESSION "cli_export_hf-missing" TIMEOUT 30)
add_test(NAME llama_train_cli_export_hf_needs_save COMMAND llama-train --export-hf ${_hf} ${_small})
set_tests_properties(llama_train_cli_export_hf_needs_save PROPERTIES PASS_REGULAR_EXPRESSION "--export-hf [^\n]* needs --save DIR")
# LoRA on a frozen base: a (2,2,1) ZeRO-3 run writes a PEFT folder that a second run reads
# back (the adapters' numbers are checked in test_train3d_lora and test_lora); bad values
# are refused naming the flag or field
set(_peft ${CMAKE_CURRENT_BINARY_DIR}/cli_lora_peft)
add_test(NAME llama_train_cli_lora COMMAND llama-train --dp 2 --tp 2 --pp 1 --zero 3 --lora-r 4 --lora-alpha 8 --rslora
         --lora-targets q_proj,v_proj,down_proj --export-lora ${_peft} ${_small})
set_tests_properties(llama_train_cli_lora PROPERTIES PASS_REGULAR_EXPRESSION
                     "step 2/2 \\| loss.*exported the LoRA adapters as the PEFT folder [^\n]*cli_lora_peft"
                     FIXTURES_SETUP train3d_lora ENVIRONMENT OPENBLAS_NUM_THREADS=1 TIMEOUT 60)
add_test(NAME llama_train_cli_lora_from COMMAND llama-train --dp 1 --tp 1 --pp 2 --lora-r 4 --lora-alpha 8 --rslora
         --lora-targets down_proj,q_proj,v_proj --lora-from ${_peft} ${_small})
set_tests_properties(llama_train_cli_lora_from PROPERTIES PASS_REGULAR_EXPRESSION
                     "LoRA adapters from the PEFT folder [^\n]*cli_lora_peft.*step 2/2 \\| loss"
                     FIXTURES_REQUIRED train3d_lora ENVIRONMENT OPENBLAS_NUM_THREADS=1 TIMEOUT 60)
# QLoRA (--lora-base nf4: the base's projections in bitsandbytes' NF4, adapters unmerged) on 4
# thread ranks under ZeRO-3 lowers the loss on the seed's chat record (tests/data): the mean
# of the last 5 of 40 steps at least 10% below the first 5's (loss_drops.cmake reads the steps)
add_test(NAME llama_train_cli_qlora_chat
         COMMAND ${CMAKE_COMMAND} "-DCMD=$<TARGET_FILE:llama-train>;--dp;4;--zero;3;--lora-base;nf4;--lora-r;16;--lora-alpha;32;--dim;64;--n-layers;2;--vocab;260;--seq;32;--batch;1;--micro-batches;1;--steps;40;--lr;3e-2;--print-every;1;--data;${PROJECT_SOURCE_DIR}/tests/data/chat_sample.jsonl"
                 -DFIRST_LAST=5 -DMARGIN_PERMIL=100 -P ${PROJECT_SOURCE_DIR}/tests/examples/llama/train/loss_drops.cmake)
set_tests_properties(llama_train_cli_qlora_chat PROPERTIES ENVIRONMENT OPENBLAS_NUM_THREADS=1 TIMEOUT 120)
add_test(NAME llama_train_cli_lora_from_mismatch COMMAND llama-train --lora-r 8 --lora-from ${_peft} ${_small})
set_tests_properties(llama_train_cli_lora_from_mismatch PROPERTIES PASS_REGULAR_EXPRESSION
                     "PEFT adapter '[^']*cli_lora_peft': r=4 lora_alpha=8 use_rslora=1, this run has r=8"
                     FIXTURES_REQUIRED train3d_lora TIMEOUT 30)
foreach(_bad "r;--lora-r;0;--lora-r must be >= 1, got 0"
             "alpha;--lora-alpha;eight;flag --lora-alpha needs a number, got 'eight'"
             "target;--lora-targets;q_proj,qproj;unknown target module 'qproj'"
             "chatglm_target;--lora-targets;query_key_value;target module 'query_key_value' is not a layer of this llama model"
             "dropout;--lora-dropout;1.5;lora_dropout must be in \\[0, 1\\), got lora_dropout=1.5"
             "base;--lora-base;int4;--lora-base must be fp32, bf16 or nf4, got 'int4'")
  list(GET _bad 0 _name)
  list(GET _bad 1 _flag)
  list(GET _bad 2 _value)
  list(GET _bad 3 _expect)
  add_test(NAME llama_train_cli_lora_bad_${_name} COMMAND llama-train --lora-r 4 ${_small} ${_flag} ${_value})
  set_tests_properties(llama_train_cli_lora_bad_${_name} PROPERTIES PASS_REGULAR_EXPRESSION "${_expect}" TIMEOUT 30)
endforeach()
# a LoRA run's sharded checkpoint (the adapters' engine state): saved on (2,1,1) ZeRO-3 after 2
# steps, resumed on (1,1,1) ZeRO-1 for 2 more; --export-hf: the model with its adapters merged
set(_lora_ckpt ${CMAKE_CURRENT_BINARY_DIR}/cli_lora_checkpoint)
add_test(NAME llama_train_cli_lora_save COMMAND llama-train --dp 2 --zero 3 --lora-r 4 --lora-dropout 0.1 --save ${_lora_ckpt} ${_small})
add_test(NAME llama_train_cli_lora_resume COMMAND llama-train --zero 1 --lora-r 4 --lora-dropout 0.1 --resume ${_lora_ckpt}
         --dim 32 --n-layers 2 --seq 16 --batch 2 --micro-batches 4 --steps 4 --data counting)
set_tests_properties(llama_train_cli_lora_save PROPERTIES PASS_REGULAR_EXPRESSION "saved checkpoint [^\n]*cli_lora_checkpoint/step-2"
                     FIXTURES_SETUP train3d_lora_ckpt ENVIRONMENT OPENBLAS_NUM_THREADS=1 TIMEOUT 60)
set_tests_properties(llama_train_cli_lora_resume PROPERTIES PASS_REGULAR_EXPRESSION
                     "resumed from [^\n]*step-2 at step 2.*step 4/4 \\| loss" FIXTURES_REQUIRED train3d_lora_ckpt
                     ENVIRONMENT OPENBLAS_NUM_THREADS=1 TIMEOUT 60)
add_test(NAME llama_train_cli_lora_export_hf COMMAND llama-train --dp 2 --zero 3 --lora-r 4 ${_small}
         --export-hf ${_lora_ckpt}-merged-hf)
set_tests_properties(llama_train_cli_lora_export_hf PROPERTIES PASS_REGULAR_EXPRESSION
                     "exported the model with its LoRA adapters merged as the HF folder [^\n]*merged-hf \\(1 safetensors file\\)"
                     ENVIRONMENT OPENBLAS_NUM_THREADS=1 TIMEOUT 60)
# --lora-merged: the adapters merged into an fp32 base each step (the unmerged run's oracle in
# test_train3d_lora / _qlora); with dropout or a quantised base it is refused, naming both
add_test(NAME llama_train_cli_lora_merged COMMAND llama-train --dp 2 --zero 2 --lora-r 4 --lora-merged ${_small})
set_tests_properties(llama_train_cli_lora_merged PROPERTIES PASS_REGULAR_EXPRESSION "step 2/2 \\| loss"
                     ENVIRONMENT OPENBLAS_NUM_THREADS=1 TIMEOUT 60)
add_test(NAME llama_train_cli_lora_merged_dropout COMMAND llama-train --lora-r 4 --lora-merged --lora-dropout 0.1 ${_small})
set_tests_properties(llama_train_cli_lora_merged_dropout PROPERTIES PASS_REGULAR_EXPRESSION
                     "lora_merged needs LoRA on an fp32 base without dropout, got lora_base=fp32 lora_dropout=0.1" TIMEOUT 30)
add_test(NAME llama_train_cli_lora_merged_nf4 COMMAND llama-train --lora-r 4 --lora-merged --lora-base nf4 ${_small})
set_tests_properties(llama_train_cli_lora_merged_nf4 PROPERTIES PASS_REGULAR_EXPRESSION
                     "lora_merged needs LoRA on an fp32 base without dropout, got lora_base=nf4" TIMEOUT 30)
# parameter groups and progressive unfreezing: the example config's 30/40/30 schedule on
# (2,2,1) ZeRO-3 prints each phase's groups where the schedule says (steps 1, 4, 8 of 10);
# by flags, LoRA's adapters unfrozen in two phases; bad values refused naming them
add_test(NAME llama_train_cli_unfreeze_config COMMAND llama-train --config ${CMAKE_CURRENT_SOURCE_DIR}/unfreeze_30_40_30.json
         --dp 2 --tp 2 ${_small} --steps 10)
set_tests_properties(llama_train_cli_unfreeze_config PROPERTIES PASS_REGULAR_EXPRESSION
                     "ZeRO-3.*step 1/10: training groups head. frozen top base\n.*step 4/10: training groups head top. frozen base\n.*step 8/10: training groups head top base\n.*step 10/10 \\| loss"
                     ENVIRONMENT OPENBLAS_NUM_THREADS=1 TIMEOUT 60)
add_test(NAME llama_train_cli_unfreeze_lora COMMAND llama-train --dp 2 --zero 2 --lora-r 4 --group "lora_top=*lora_*@-1:"
         --group "lora=*lora_*" --unfreeze "0.5:lora_top,1:lora_top+lora" --group-lr lora_top=1e-2 ${_small} --steps 4)
set_tests_properties(llama_train_cli_unfreeze_lora PROPERTIES PASS_REGULAR_EXPRESSION
                     "step 1/4: training groups lora_top. frozen lora base\n.*step 3/4: training groups lora_top lora. frozen base\n.*step 4/4 \\| loss"
                     ENVIRONMENT OPENBLAS_NUM_THREADS=1 TIMEOUT 60)
# the seed's recipe: LoRA, then the top layer's base, then everything, under the seed's ZeRO-3
# (the base partitioned, each unit gathered for the frozen ops); with LoRA dropout; the fp32
# base runs unmerged and its unfrozen weights take their gradient from the frozen ops
add_test(NAME llama_train_cli_unfreeze_lora_base COMMAND llama-train --dp 2 --zero 3 --lora-r 4 --lora-dropout 0.1 --group "lora=*lora_*"
         --group top=@-1: --unfreeze "0.3:lora,0.7:lora+top,1:lora+top+base" --group-lr lora=3e-3 --group-lr base=1e-4
         ${_small} --steps 10)
set_tests_properties(llama_train_cli_unfreeze_lora_base PROPERTIES PASS_REGULAR_EXPRESSION
                     "step 1/10: training groups lora. frozen top base\n.*step 4/10: training groups lora top. frozen base\n.*step 8/10: training groups lora top base\n.*step 10/10 \\| loss"
                     ENVIRONMENT OPENBLAS_NUM_THREADS=1 TIMEOUT 60)
set(_unfreeze_bad_lora "--zero;3;--lora-r;4;--lora-merged;--group;lora=*lora_*;--unfreeze;0.5:lora,1:lora+base")
set(_unfreeze_bad_frozen_lr "--group;top=@-1:;--unfreeze;1:base;--group-lr;top=0.001")
set(_unfreeze_bad_unknown "--group-lr;nosuch=0.001")
set(_unfreeze_bad_phase "--unfreeze;0.3lora")
set(_unfreeze_bad_both "--config;${CMAKE_CURRENT_SOURCE_DIR}/unfreeze_30_40_30.json;--unfreeze;1:base")
set(_unfreeze_expect_lora "lora_merged with progressive_unfreezing training base tensor .*\\(group \"base\"\\) needs ZeRO stage <= 2")
set(_unfreeze_expect_frozen_lr "group \"top\" is frozen in every phase but is given lr=0.001")
set(_unfreeze_expect_unknown "--group-lr names group \"nosuch\", which no --group or param_groups defines")
set(_unfreeze_expect_phase "--unfreeze phase '0.3lora' is not UNTIL:GROUP")
set(_unfreeze_expect_both "--group / --unfreeze and the config's \"param_groups\"")
foreach(_bad lora frozen_lr unknown phase both)
  add_test(NAME llama_train_cli_unfreeze_bad_${_bad} COMMAND llama-train ${_small} ${_unfreeze_bad_${_bad}})
  set_tests_properties(llama_train_cli_unfreeze_bad_${_bad} PROPERTIES PASS_REGULAR_EXPRESSION "${_unfreeze_expect_${_bad}}"
                       TIMEOUT 30)
endforeach()
# a save killed at each point of its protocol leaves the previous checkpoint loadable
add_test(NAME llama_train_checkpoint_crash
         COMMAND ${CMAKE_COMMAND} -DTRAIN=$<TARGET_FILE:llama-train> -DWORKDIR=${CMAKE_CURRENT_BINARY_DIR}
                 -P ${PROJECT_SOURCE_DIR}/tests/examples/llama/model3d/checkpoint_crash_check.cmake)
set_tests_properties(llama_train_checkpoint_crash PROPERTIES ENVIRONMENT OPENBLAS_NUM_THREADS=1 TIMEOUT 240)
add_test(NAME llama_train_cli_precision_contradicts_config
         COMMAND llama-train --config ${PROJECT_SOURCE_DIR}/tests/io/config/ds_config_zero3.json --precision bf16 ${_small})
set_tests_properties(llama_train_cli_precision_contradicts_config PROPERTIES PASS_REGULAR_EXPRESSION
                     "--precision bfloat16 contradicts the config's float16" TIMEOUT 30)
add_test(NAME llama_train_cli_bad_precision COMMAND llama-train --precision fp8 ${_small})
set_tests_properties(llama_train_cli_bad_precision PROPERTIES PASS_REGULAR_EXPRESSION
                     "--precision must be fp32, bf16 or fp16, got 'fp8'" TIMEOUT 30)
set_tests_properties(llama_train_cli_help PROPERTIES PASS_REGULAR_EXPRESSION "usage: llama-train" TIMEOUT 30)
set_tests_properties(llama_train_cli_222 PROPERTIES PASS_REGULAR_EXPRESSION
                     "mesh dp=2 x tp=2 x pp=2.*rank 7 \\(dp=1, tp=1, pp=1\\): layers \\[1, 2\\) \\+norm\\+output.*step 2/2 \\| loss"
                     ENVIRONMENT OPENBLAS_NUM_THREADS=1 TIMEOUT 60)
set_tests_properties(llama_train_cli_heads PROPERTIES PASS_REGULAR_EXPRESSION "n_heads \\(4\\) must be divisible by tp \\(3\\)"
                     TIMEOUT 30)
set_tests_properties(llama_train_cli_layers PROPERTIES PASS_REGULAR_EXPRESSION "n_layers \\(2\\) must be >= pp x chunks \\(3 x 1\\)"
                     TIMEOUT 30)
add_test(NAME llama_train_cli_bad_number COMMAND llama-train --steps ten)
set_tests_properties(llama_train_cli_bad_number PROPERTIES PASS_REGULAR_EXPRESSION "flag --steps needs a number, got 'ten'"
                                                           TIMEOUT 30)
