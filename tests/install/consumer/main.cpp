// A user's first program against an installed loom.
#include <loom/core.hpp>

#include <cstdio>

int main() {
  loom::host_memory_resource mem("app");
  loom::buffer<float> b(3, mem);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(i + 1);
  float sum = 0;
  for (float x : b) sum += x;
  LOOM_CHECK(mem.current_bytes() == 12, "bytes=", mem.current_bytes());
  std::printf("consumer ok: sum=%g half=0x%04x\n", sum, static_cast<unsigned>(loom::half(1.0f).bits));
  return 0;
}
