// StepPhase: where the optimizer is in its step, as one explicit state
// checked at each transition. Internal to csrc/optimizer/.
//
// [Note: the step's phase]
// A step changes nothing until its one flags agreement (kAgreeing): a
// failure there (a detached parameter, hyper-parameters that differ between
// ranks) leaves the state as it was and the gradients for a retry. From the
// update on (kUpdating) it writes the shards group by group, and a failure
// (a rule that fails on one rank, an NVMe error; both agreed, so every rank
// raises) leaves some shards stepped and others not: no step's state, and
// parameters that no longer match their master. Training on from there, or
// saving it, is a silent wrong answer, so the optimizer stays kIncomplete
// until a load replaces the state: step() refuses on every rank (through the
// step's agreement), a save (through its own) or state_dict() refuses, a load
// with the optimizer states restores kReady. A load that fails after it began
// writing leaves the state incomplete too.
// A step entered while one is running (from a closure or a hook) raises.
#pragma once

#include <c10/util/Exception.h>

#include <string>

namespace zeroshard {

class StepPhase {
 public:
  enum class Phase { kReady, kAgreeing, kUpdating, kIncomplete };

  Phase phase() const { return phase_; }

  // step() begins. Returns why it must not go on ("" when it may): the
  // refusal every rank agrees on before raising.
  std::string begin() {
    TORCH_CHECK(phase_ == Phase::kReady || phase_ == Phase::kIncomplete,
                "step() was called while a step() is running (from its closure, a hook or "
                "another thread); call it once per iteration, after backward");
    before_ = phase_;
    phase_ = Phase::kAgreeing;
    return before_ == Phase::kIncomplete ? refusal() : std::string();
  }
  // The ranks agreed to update: the shards start changing.
  void start_update() {
    TORCH_INTERNAL_ASSERT(phase_ == Phase::kAgreeing, "the update starts after the agreement");
    phase_ = Phase::kUpdating;
  }
  void end() {
    TORCH_INTERNAL_ASSERT(phase_ == Phase::kAgreeing || phase_ == Phase::kUpdating,
                          "a step ends once it began");
    phase_ = Phase::kReady;
  }
  // The step raised `why`: nothing changed before the update; from it on,
  // the state is incomplete.
  void failed(const std::string& why) {
    if (phase_ == Phase::kAgreeing) {
      phase_ = before_;
    } else if (phase_ == Phase::kUpdating) {
      phase_ = Phase::kIncomplete;
      why_ = why.substr(0, why.find('\n'));
    }
  }
  // A load failed after it began writing the state: as incomplete as a
  // failed update (not during a step).
  void mark_incomplete(const std::string& why) {
    if (phase_ == Phase::kReady || phase_ == Phase::kIncomplete) {
      phase_ = Phase::kIncomplete;
      why_ = why.substr(0, why.find('\n'));
    }
  }
  // A load replaced the whole state (checkpoint or state dict).
  void restored() {
    TORCH_CHECK(phase_ == Phase::kReady || phase_ == Phase::kIncomplete,
                "the optimizer state cannot be loaded during step()");
    phase_ = Phase::kReady;
    why_.clear();
  }
  // Why the state must not be saved or stepped ("" when it may).
  std::string incomplete_reason() const {
    return phase_ == Phase::kIncomplete ? refusal() : std::string();
  }
  // Throws for `what` (a local call: state_dict()) while the state is
  // incomplete.
  void check_complete(const char* what) const {
    TORCH_CHECK(phase_ != Phase::kIncomplete, "zeroshard: ", what, " refused: ", refusal());
  }

 private:
  std::string refusal() const {
    return "an earlier step() or load failed while writing the shards (" + why_ +
           "), so some are written and others not, and the parameters may not match their "
           "master weights; load a checkpoint with its optimizer states (load_checkpoint, or "
           "load_state_dict) to go on";
  }

  Phase phase_ = Phase::kReady;
  Phase before_ = Phase::kReady;  // the phase begin() found
  std::string why_;               // the failure that left the state incomplete
};

}  // namespace zeroshard
