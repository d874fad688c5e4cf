#pragma once
// The server tests' model: small enough that a request completes in milliseconds, with GQA and
// an untied output so the server runs the decoder's general path.
#include "llama_server.hpp"

namespace serve_test {

inline llama::config small_model(int max_seq_len = 192, int dim = 48, int layers = 2) {
  llama::config c;
  c.dim = dim, c.hidden_dim = 2 * dim, c.n_layers = layers, c.n_heads = 4, c.n_kv_heads = 2, c.vocab = 259;
  c.seq_len = max_seq_len;
  c.tied_output = false;
  return c;
}

}  // namespace serve_test
