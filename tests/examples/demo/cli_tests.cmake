# loom-demo's tests (loom_example_tests: run in examples/demo's scope): a short run end to end,
# and a bad value refused.
add_test(NAME loom_demo_smoke COMMAND loom-demo --steps 3 --max-new 4 --out ${CMAKE_CURRENT_BINARY_DIR}/smoke)
add_test(NAME loom_demo_bad_args COMMAND loom-demo --dp zero)
set_tests_properties(loom_demo_bad_args PROPERTIES WILL_FAIL TRUE)
set_tests_properties(loom_demo_smoke PROPERTIES TIMEOUT 300 ENVIRONMENT "OPENBLAS_NUM_THREADS=1")
