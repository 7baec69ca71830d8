// Small text helpers shared by the readers of user-written names (devices,
// optimizers, precision recipes, config keys), which all ignore case.
#pragma once

#include <algorithm>
#include <cctype>
#include <string>

namespace zeroshard {

// `text` in lower case (ASCII; the names compared are ASCII). The cast to
// unsigned char keeps std::tolower defined for bytes above 127.
inline std::string lowercase(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text;
}

}  // namespace zeroshard
