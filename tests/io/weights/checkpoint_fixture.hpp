// Test fixture: runs the independent Python writer (make_checkpoints.py, numpy + PyTorch) into a
// fresh temporary folder once per test program and parses its expected.json.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <unistd.h>

#ifndef LOOM_CHECKPOINT_SCRIPT
#error "LOOM_CHECKPOINT_SCRIPT must name make_checkpoints.py"
#endif

struct checkpoint_files {
  std::filesystem::path dir;
  nlohmann::json expected;
  checkpoint_files() {
    dir = std::filesystem::temp_directory_path() / ("loom_ckpt_" + std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    const std::string cmd = std::string("/usr/bin/python3 ") + LOOM_CHECKPOINT_SCRIPT + " " + dir.string();
    if (std::system(cmd.c_str()) != 0) throw std::runtime_error("checkpoint writer failed: " + cmd);
    std::ifstream f(dir / "expected.json");
    expected = nlohmann::json::parse(f);
  }
  ~checkpoint_files() { std::filesystem::remove_all(dir); }
  std::string path(const std::string& name) const { return (dir / name).string(); }
  static const checkpoint_files& get() {
    static checkpoint_files files;
    return files;
  }
};
