#pragma once
// llama_server: loom::serve's HTTP server over the paged-KV LLaMA engine (llama_engine.hpp).
// The server, its protocols and limits are the library's (include/loom/serve); what this
// example chooses is the engine and its weights.

#include "llama_engine.hpp"

#include <loom/serve/http_server.hpp>

namespace llama {

class llama_server : public loom::serve::http_server<llama_engine<float>> {
 public:
  /// `w` must outlive the server (the engine reads it on every step). `adapters`: LoRA
  /// adapters over w that a request chooses by its field "model" (the adapter's name).
  llama_server(const flat_weights& w, engine_config ec, loom::serve::text_codec codec, loom::serve::server_options opt = {},
               std::vector<served_adapter> adapters = {})
      : http_server(std::move(codec), std::move(opt), w, ec, std::move(adapters)) {}
};

}  // namespace llama
