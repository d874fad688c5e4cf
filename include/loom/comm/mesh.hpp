#pragma once
// mesh: the data x tensor x pipeline parallel process groups of a world communicator.
//
// Rank order follows Megatron-LM: tensor-parallel ranks are adjacent (fastest varying, so
// they share a host and its fast links), then data-parallel, then pipeline stages:
//
//   world_rank = pp_index * (dp * tp) + dp_index * tp + tp_index
//
// The groups are made with the communicator's split (a collective: every rank of the world
// constructs the mesh together), ordered by their coordinate along the axis, so a rank's
// position in its tp group is its tp index, and so on:
//   tp() : same (pp, dp), varying tp      -- tensor-parallel all-reduce / all-gather
//   dp() : same (pp, tp), varying dp      -- gradient reduce-scatter, ZeRO all-gather
//   pp() : same (dp, tp), varying pp      -- stage-to-stage send/recv
//   mp() : same dp, all (pp, tp)          -- model-parallel group (global grad norm, overflow)
// The mesh refers to the world it was built from (it does not own it).

#include <loom/comm/communicator.hpp>
#include <loom/core/error.hpp>

#include <ostream>

namespace loom::comm {

struct mesh_shape {
  int dp = 1, tp = 1, pp = 1;
  int size() const noexcept { return dp * tp * pp; }
  friend bool operator==(const mesh_shape&, const mesh_shape&) = default;
};

struct mesh_coord {
  int dp = 0, tp = 0, pp = 0;
  friend bool operator==(const mesh_coord&, const mesh_coord&) = default;
  friend std::ostream& operator<<(std::ostream& os, const mesh_coord& c) {
    return os << "(dp=" << c.dp << ", tp=" << c.tp << ", pp=" << c.pp << ')';
  }
};

/// The world rank at coordinate c (Megatron order: tp fastest, then dp, then pp).
constexpr int mesh_rank(mesh_shape s, mesh_coord c) noexcept { return (c.pp * s.dp + c.dp) * s.tp + c.tp; }

/// The coordinate of world rank r.
constexpr mesh_coord mesh_coords(mesh_shape s, int r) noexcept { return {(r / s.tp) % s.dp, r % s.tp, r / (s.tp * s.dp)}; }

inline void check_mesh_shape(mesh_shape s, int world_size) {
  LOOM_CHECK(s.dp >= 1 && s.tp >= 1 && s.pp >= 1, "mesh: dp=", s.dp, ", tp=", s.tp, ", pp=", s.pp, " must all be >= 1");
  LOOM_CHECK(s.size() == world_size, "mesh: dp x tp x pp = ", s.dp, " x ", s.tp, " x ", s.pp, " = ", s.size(),
             " must equal the world size ", world_size);
}

/// Requires: C is a communicator (communicator.hpp).
template <communicator C>
class mesh {
 public:
  /// Collective over `world`: every rank constructs its mesh with the same shape.
  mesh(C& world, mesh_shape shape)
      : world_(&world), shape_((check_mesh_shape(shape, world.size()), shape)), coord_(mesh_coords(shape, world.rank())),
        tp_(world.split(coord_.pp * shape.dp + coord_.dp, coord_.tp)),
        dp_(world.split(coord_.pp * shape.tp + coord_.tp, coord_.dp)),
        pp_(world.split(coord_.dp * shape.tp + coord_.tp, coord_.pp)),
        mp_(world.split(coord_.dp, coord_.pp * shape.tp + coord_.tp)) {}
  mesh(C& world, int dp, int tp, int pp) : mesh(world, mesh_shape{dp, tp, pp}) {}

  mesh_shape shape() const noexcept { return shape_; }
  mesh_coord coord() const noexcept { return coord_; }
  C& world() noexcept { return *world_; }
  C& tp() noexcept { return tp_; }
  C& dp() noexcept { return dp_; }
  C& pp() noexcept { return pp_; }
  C& mp() noexcept { return mp_; }

  bool first_stage() const noexcept { return coord_.pp == 0; }
  bool last_stage() const noexcept { return coord_.pp == shape_.pp - 1; }
  /// Rank in pp() of the next / previous stage (-1 at the ends).
  int next_stage() const noexcept { return last_stage() ? -1 : coord_.pp + 1; }
  int prev_stage() const noexcept { return first_stage() ? -1 : coord_.pp - 1; }

 private:
  C* world_;
  mesh_shape shape_;
  mesh_coord coord_;
  C tp_, dp_, pp_, mp_;
};

}  // namespace loom::comm
