// Which kind of model parallelism an optimizer's model-parallel group is: its
// own header so that the public optimizer header names it without pulling in
// the communicators.
#pragma once

namespace zeroshard {

// What the model-parallel group holds beside this rank's tensors: other
// pieces of split tensors and copies of the rest (tensor parallelism), or
// other experts (expert parallelism); kNone before either is set.
enum class ModelParallel { kNone, kTensor, kExpert };

}  // namespace zeroshard
