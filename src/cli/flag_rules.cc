// One parser for the integer and size flags (cli/flag_rules.h, docs/notes/flags.md).
#include "cli/flag_rules.h"

#include <fmt/format.h>

#include "core/units.h"
#include "core/utf8.h"

namespace headroom::cli {

namespace {

// The accepted values, for messages: "from 1 to 1048576, or auto (the planner's choice)".
std::string accepted(const IntRule& rule) {
  std::string s = rule.max == std::numeric_limits<uint64_t>::max()
                      ? fmt::format("{} or more", rule.min)
                      : fmt::format("from {} to {}", rule.min, rule.max);
  if (rule.auto_means) s += fmt::format(", or auto ({})", rule.auto_means);
  return s;
}

}  // namespace

Result<std::optional<uint64_t>> parse_int_flag(std::string_view flag, std::string_view text,
                                               const IntRule& rule) {
  if (rule.auto_means && text == "auto") return std::optional<uint64_t>();
  // The value is quoted in a message that may be written as JSON: valid UTF-8 only.
  const std::string shown = valid_utf8(text);
  const std::string what = *rule.what ? fmt::format(" ({})", rule.what) : std::string();
  std::string_view digits = text;
  bool negative = false;
  if (!digits.empty() && (digits[0] == '+' || digits[0] == '-')) {
    negative = digits[0] == '-';
    digits.remove_prefix(1);
  }
  bool all_digits = !digits.empty();
  for (char c : digits) all_digits = all_digits && c >= '0' && c <= '9';
  if (!all_digits) {
    return Status::invalid_argument(
        fmt::format("{} {}: not a whole number{}; give one {}", flag, shown, what, accepted(rule)));
  }
  uint64_t v = 0;
  bool overflow = false;
  for (char c : digits) {
    const uint64_t d = uint64_t(c - '0');
    if (v > (std::numeric_limits<uint64_t>::max() - d) / 10) overflow = true;
    v = overflow ? v : v * 10 + d;
  }
  if (negative && (v != 0 || overflow)) {
    return Status::invalid_argument(fmt::format("{} {}: must not be negative{}; give a value {}",
                                                flag, shown, what, accepted(rule)));
  }
  if (overflow || v > rule.max) {
    return Status::invalid_argument(
        fmt::format("{} {}: too large{}; give a value {}", flag, shown, what, accepted(rule)));
  }
  if (v < rule.min) {
    std::string hint = rule.auto_means ? fmt::format("; leave {} out or give {} auto for {}", flag,
                                                     flag, rule.auto_means)
                                       : std::string();
    return Status::invalid_argument(
        fmt::format("{} {}: must be at least {}{}{}", flag, shown, rule.min, what, hint));
  }
  return std::optional<uint64_t>(v);
}

Result<std::optional<uint64_t>> parse_size_flag(std::string_view flag, std::string_view text,
                                                bool auto_ok) {
  if (auto_ok && (text == "auto" || text.empty())) return std::optional<uint64_t>();
  const std::string shown = valid_utf8(text);
  const char* or_auto = auto_ok ? ", or auto" : "";
  Result<uint64_t> b = parse_bytes(text);
  if (!b.is_ok()) {
    return Status::invalid_argument(fmt::format(
        "{} {}: not a size (give one such as 4GiB, 512MiB, 24GB or a number of bytes{})", flag,
        shown, or_auto));
  }
  if (*b == 0) {
    return Status::invalid_argument(
        fmt::format("{} {}: a budget of 0 bytes holds nothing; give a positive size such as 4GiB{}",
                    flag, shown, auto_ok ? " (or auto, the default)" : ""));
  }
  return std::optional<uint64_t>(*b);
}

CLI::Option* add_size_flag(CLI::App* app, const std::string& name, std::string& target,
                           bool auto_ok, const std::string& help, bool show_default) {
  CLI::Option* o = app->add_option_function<std::string>(
      name,
      [&target, name, auto_ok](const std::string& text) {
        Result<std::optional<uint64_t>> v = parse_size_flag(name, text, auto_ok);
        if (!v.is_ok()) throw FlagValueError(v.status().message());
        target = text;
      },
      help);
  o->type_name(auto_ok ? "SIZE|auto" : "SIZE");
  if (show_default) o->default_str(target);
  return o;
}

}  // namespace headroom::cli
