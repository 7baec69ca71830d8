// Internal to csrc/config: reading one JSON section with exact key checks,
// typed accessors and error messages naming the key's path. Shared by the
// config reader (deepspeed_config.cpp) and the LR schedules (lr_schedule.cpp).
#pragma once

#include "zeroshard/deepspeed_config.h"
#include "zeroshard/text.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace zeroshard::config_detail {

using nlohmann::json;
using Keys = std::vector<std::string>;

constexpr int64_t kNoMax = std::numeric_limits<int64_t>::max();
constexpr double kInf = std::numeric_limits<double>::infinity();

// ---------------------------------------------------------------------------
// Helpers.

// Levenshtein distance, ignoring case (a mistyped key is as often a wrong case as a wrong
// letter).
inline size_t edit_distance(const std::string& a, const std::string& b) {
  const std::string x = lowercase(a), y = lowercase(b);
  std::vector<size_t> row(y.size() + 1);
  for (size_t j = 0; j <= y.size(); ++j) {
    row[j] = j;
  }
  for (size_t i = 1; i <= x.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= y.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({above + 1, row[j - 1] + 1, diagonal + (x[i - 1] == y[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[y.size()];
}

inline std::string closest(const std::string& word, const Keys& candidates) {
  std::string best;
  size_t best_distance = std::numeric_limits<size_t>::max();
  for (const auto& candidate : candidates) {
    const size_t distance = edit_distance(word, candidate);
    if (distance < best_distance) {
      best = candidate;
      best_distance = distance;
    }
  }
  return best;
}

// The entry of `names` equal to `name` ignoring case, or "".
inline std::string find_name(const std::string& name, const Keys& names) {
  for (const auto& candidate : names) {
    if (lowercase(candidate) == lowercase(name)) {
      return candidate;
    }
  }
  return "";
}

inline std::string quoted_list(const Keys& names) {
  std::string text;
  for (size_t i = 0; i < names.size(); ++i) {
    text += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + ("\"" + names[i] + "\"");
  }
  return text;
}

inline std::string child_path(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}

// Sizes are often written as floats (5e8): any integral number is an integer.
inline std::optional<int64_t> as_integer(const json& value) {
  if (value.is_number_unsigned()) {
    const auto v = value.get<uint64_t>();
    if (v > static_cast<uint64_t>(kNoMax)) {
      return std::nullopt;
    }
    return static_cast<int64_t>(v);
  }
  if (value.is_number_integer()) {
    return value.get<int64_t>();
  }
  if (value.is_number_float()) {
    const double v = value.get<double>();
    const double limit = std::ldexp(1.0, 63);
    if (std::isfinite(v) && std::floor(v) == v && v >= -limit && v < limit) {
      return static_cast<int64_t>(v);
    }
  }
  return std::nullopt;
}

inline std::string integer_range(int64_t min, int64_t max) {
  if (max == kNoMax) {
    return min == std::numeric_limits<int64_t>::min() ? "an integer"
                                                      : "an integer >= " + std::to_string(min);
  }
  return "an integer " + std::to_string(min) + ".." + std::to_string(max);
}

inline std::string number_range(double min, double max) {
  if (max == kInf) {
    return min == -kInf ? "a number" : c10::str("a number >= ", min);
  }
  return c10::str("a number in [", min, ", ", max, "]");
}

// One JSON object of the config, with its dotted path for messages. Construction rejects
// unknown keys; the readers reject values of the wrong type or range. A JSON null reads as an
// absent key (DeepSpeed's Optional fields).
class Section {
 public:
  Section(const json* value, std::string path, const Keys& known)
      : value_(value), path_(std::move(path)) {
    if (value_ == nullptr) {
      return;
    }
    TORCH_CHECK_VALUE(value_->is_object(), path_, " must be an object, got ", *value_);
    for (const auto& item : value_->items()) {
      if (std::find(known.begin(), known.end(), item.key()) == known.end()) {
        TORCH_CHECK_VALUE(false, "unknown key \"", item.key(), "\" in ",
                          path_.empty() ? "the config" : path_, "; did you mean \"",
                          closest(item.key(), known), "\"?");
      }
    }
  }

  std::string path(const std::string& key) const { return child_path(path_, key); }

  // Whether the key holds the string "auto" (which find() refuses): for the settings
  // zeroshard resolves itself (zero_optimization.stage, offload_*.device).
  bool is_auto(const std::string& key) const {
    if (value_ == nullptr) {
      return false;
    }
    const auto it = value_->find(key);
    return it != value_->end() && it->is_string() && it->get<std::string>() == "auto";
  }

  const json* find(const std::string& key) const {
    if (value_ == nullptr) {
      return nullptr;
    }
    const auto it = value_->find(key);
    if (it == value_->end() || it->is_null()) {
      return nullptr;
    }
    // The Hugging Face Trainer writes "auto" for values it derives from its own arguments and
    // fills them in before DeepSpeed reads the config; one left here was never filled in.
    TORCH_CHECK_VALUE(!(it->is_string() && it->get<std::string>() == "auto"), path(key),
                      " is \"auto\": \"auto\" values are placeholders that the Hugging Face "
                      "integration fills in; the caller must replace it with a value");
    return &*it;
  }

  bool has(const std::string& key) const { return find(key) != nullptr; }

  bool boolean(const std::string& key, bool fallback) const {
    const json* v = find(key);
    if (v == nullptr) {
      return fallback;
    }
    TORCH_CHECK_VALUE(v->is_boolean(), path(key), " must be true or false, got ", *v);
    return v->get<bool>();
  }

  std::optional<int64_t> optional_integer(const std::string& key, int64_t min,
                                          int64_t max = kNoMax) const {
    const json* v = find(key);
    if (v == nullptr) {
      return std::nullopt;
    }
    const auto n = as_integer(*v);
    TORCH_CHECK_VALUE(n && *n >= min && *n <= max, path(key), " must be ", integer_range(min, max),
                      ", got ", *v);
    return n;
  }

  int64_t integer(const std::string& key, int64_t fallback, int64_t min,
                  int64_t max = kNoMax) const {
    return optional_integer(key, min, max).value_or(fallback);
  }

  std::optional<double> optional_number(const std::string& key, double min = -kInf,
                                        double max = kInf) const {
    const json* v = find(key);
    if (v == nullptr) {
      return std::nullopt;
    }
    const bool ok = v->is_number() && std::isfinite(v->get<double>()) && v->get<double>() >= min &&
                    v->get<double>() <= max;
    TORCH_CHECK_VALUE(ok, path(key), " must be ", number_range(min, max), ", got ", *v);
    return v->get<double>();
  }

  double number(const std::string& key, double fallback, double min = -kInf,
                double max = kInf) const {
    return optional_number(key, min, max).value_or(fallback);
  }

  std::string string(const std::string& key, const std::string& fallback) const {
    const json* v = find(key);
    if (v == nullptr) {
      return fallback;
    }
    TORCH_CHECK_VALUE(v->is_string(), path(key), " must be a string, got ", *v);
    return v->get<std::string>();
  }

  // One of `choices`, ignoring case; returns the choice's own spelling.
  std::string choice(const std::string& key, const std::string& fallback,
                     const Keys& choices) const {
    const std::string value = string(key, fallback);
    const std::string match = find_name(value, choices);
    TORCH_CHECK_VALUE(!match.empty(), path(key), " must be ", quoted_list(choices), ", got \"",
                      value, "\"; did you mean \"", closest(value, choices), "\"?");
    return match;
  }

  Section section(const std::string& key, const Keys& known) const {
    return Section(find(key), path(key), known);
  }

 private:
  const json* value_;  // an object, or null when the section is absent
  std::string path_;   // "" at the top level
};

// Records a setting zeroshard does not implement (see [Note: Unsupported settings]).
inline void flag(DeepSpeedConfig& out, const std::string& path, const json& value,
                 const std::string& why) {
  out.unsupported.push_back(
      c10::str(path, " = ", value, " is not supported yet by zeroshard (", why, ")"));
}

// Reads the "optimizer" section (optimizer_config.cpp).
void read_optimizer(const Section& top, DeepSpeedConfig& out);

// Reads the "scheduler" section (lr_schedule.cpp).
void read_scheduler(const Section& top, DeepSpeedConfig& out);

// offload_config.cpp: an offload section (`key` of zero_optimization) with
// DeepSpeed's defaults (`written`: the device as the config names it), and
// the top-level "aio" section into out.zero.aio().
OffloadOptions read_offload(const Section& zero, const std::string& key, bool pin_default,
                            DeepSpeedConfig& out, OffloadDevice* written);
void read_aio(const Section& top, DeepSpeedConfig& out);

}  // namespace zeroshard::config_detail
