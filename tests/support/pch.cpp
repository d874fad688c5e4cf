// The source of loom_test_pch (cmake/loom_testing.cmake): its precompiled header is what the
// test programs reuse; this file itself holds nothing.
