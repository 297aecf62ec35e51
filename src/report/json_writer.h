// The report's one JSON writer: memory.json (and the same figures in report.html's data blob) and
// trace.json's header, metadata and markers go through it. The loops over 10^6 events (trace.json's
// spans, counters and instant events; report.html's timeline columns) append their few fixed keys
// directly, with names escaped once per distinct string, so they format in seconds.
#pragma once

#include <fmt/format.h>

#include <iterator>
#include <optional>
#include <string>

#include "report/profile.h"

namespace headroom::report::detail {

// Appends JSON to a string: objects, arrays, keys and values, with the commas placed by the
// writer (key() and value() know whether one is due). Strings are escaped by append_json_string
// (safe inside an HTML <script>), numbers by append_json_number (NaN and infinities as null).
// Starts fresh: the first value written needs no comma, so an object may be appended to text
// that already ends with one.
class JsonWriter {
 public:
  explicit JsonWriter(std::string& out) : out_(out) {}
  void begin_object() { open('{'); }
  void end_object() { close('}'); }
  void begin_array() { open('['); }
  void end_array() { close(']'); }
  void key(const std::string& k) {
    comma();
    append_json_string(out_, k);
    out_.push_back(':');
    fresh_ = true;  // the value that follows needs no comma
  }
  void value(const std::string& s) {
    comma();
    append_json_string(out_, s);
  }
  void value(const char* s) { value(std::string(s)); }
  void value(double v) {
    comma();
    append_json_number(out_, v);
  }
  void value(uint64_t v) {
    comma();
    fmt::format_to(std::back_inserter(out_), "{}", v);
  }
  void value(int v) {
    comma();
    fmt::format_to(std::back_inserter(out_), "{}", v);
  }
  void value(bool v) {
    comma();
    out_ += v ? "true" : "false";
  }
  void null() {
    comma();
    out_ += "null";
  }
  template <typename T>
  void field(const std::string& k, const T& v) {
    key(k);
    value(v);
  }
  template <typename T>
  void optional_field(const std::string& k, const std::optional<T>& v) {
    key(k);
    if (v) {
      value(*v);
    } else {
      null();
    }
  }

 private:
  void comma() {
    if (!fresh_) out_.push_back(',');
    fresh_ = false;
  }
  void open(char c) {
    comma();
    out_.push_back(c);
    fresh_ = true;
  }
  void close(char c) {
    out_.push_back(c);
    fresh_ = false;
  }
  std::string& out_;
  bool fresh_ = true;
};

}  // namespace headroom::report::detail
