// Integer and size flags of every subcommand: one parser, one set of rules, one kind of message
// (docs/notes/flags.md). `--batch 0` used to train silently with the planner's choice.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

#include "core/status.h"

namespace headroom::cli {

// What an integer flag accepts: whole numbers in [min, max] written in decimal (an optional
// leading '+'; no sign, spaces, exponent or suffix), and the word "auto" where auto_means says
// what it means. 0 is accepted only where min is 0, and then the flag's --help says what 0 means.
struct IntRule {
  uint64_t min = 1;
  uint64_t max = std::numeric_limits<int32_t>::max();
  const char* what = "";             // what the value is: "the micro-batch in sequences"
  const char* auto_means = nullptr;  // non-null: "auto" is accepted and means this
};

// The value of integer flag `flag` (e.g. "--batch") given as `text`, or nullopt for "auto".
// Errors name the flag, the value, the accepted range and what to do instead.
Result<std::optional<uint64_t>> parse_int_flag(std::string_view flag, std::string_view text,
                                               const IntRule& rule);

// The value of size flag `flag` (e.g. "--device-memory"): a positive size as parse_bytes reads it
// ("4GiB", "512MiB", "24GB", a number of bytes), or nullopt for "auto" where auto_ok.
Result<std::optional<uint64_t>> parse_size_flag(std::string_view flag, std::string_view text,
                                                bool auto_ok);

// A flag value the rules refuse, thrown from CLI11's parse: the command line's edge prints it as
// "headroom: error: MESSAGE" and exits 1, as for any other bad input.
class FlagValueError : public CLI::ValidationError {
 public:
  explicit FlagValueError(std::string message) : CLI::ValidationError(std::move(message), 1) {}
};

// Registers integer flag `name` on `app`, storing into `target` (an int or uint64_t) through
// parse_int_flag, and `auto_value` for "auto". A refused value is a FlagValueError: the command
// stops with the message before any work. `target`'s value is shown as the default when
// show_default.
template <typename T>
CLI::Option* add_int_flag(CLI::App* app, const std::string& name, T& target, const IntRule& rule,
                          const std::string& help, bool show_default = false, T auto_value = T(0)) {
  static_assert(std::is_same_v<T, int> || std::is_same_v<T, uint64_t>);
  CLI::Option* o = app->add_option_function<std::string>(
      name,
      [&target, name, rule, auto_value](const std::string& text) {
        Result<std::optional<uint64_t>> v = parse_int_flag(name, text, rule);
        if (!v.is_ok()) throw FlagValueError(v.status().message());
        target = v->has_value() ? static_cast<T>(**v) : auto_value;
      },
      help);
  o->type_name(rule.auto_means ? "INT|auto" : "INT");
  if (show_default) o->default_str(std::to_string(target));
  return o;
}

// Registers size flag `name` on `app`, storing the text into `target` once parse_size_flag
// accepts it (the command parses it again where it is used).
CLI::Option* add_size_flag(CLI::App* app, const std::string& name, std::string& target,
                           bool auto_ok, const std::string& help, bool show_default = false);

}  // namespace headroom::cli
