// A device the host cannot touch, for tests on a machine without a GPU (docs/notes/
// fenced-device.md): every block is its own anonymous mapping, and while the resource is fenced
// every block is PROT_NONE, so that a host read or write of it outside an op (FencedOps opens a
// window around each one) dies with SIGSEGV at the touching instruction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>

#include "memory/resource.h"

namespace headroom::backend {

// Thread safety: every method may be called from several threads. A window opened on one thread
// opens the memory to every thread (mprotect is process-wide): the fence catches touches from
// outside an op only while no op is running.
class FencedResource final : public memory::MemoryResource {
 public:
  FencedResource() = default;
  // Unmaps the blocks still live (a test that leaks a block leaks no mapping).
  ~FencedResource() override;
  FencedResource(const FencedResource&) = delete;
  FencedResource& operator=(const FencedResource&) = delete;

  // fence(): from now on the blocks are PROT_NONE, except while a window is open; blocks
  // allocated later are born so. unfence(): PROT_READ | PROT_WRITE, as host memory.
  void fence();
  void unfence();
  bool fenced() const;

  // An op's access: while at least one Window lives the blocks are readable and writable; when
  // the last one closes they are fenced again (if the resource is fenced). Windows nest.
  class Window {
   public:
    explicit Window(FencedResource* r);
    ~Window();
    Window(const Window&) = delete;
    Window& operator=(const Window&) = delete;

   private:
    FencedResource* r_;
  };

  // Whether [p, p + bytes) lies inside one live block (tests).
  bool contains(const void* p, size_t bytes = 1) const;
  size_t live_blocks() const;
  // mprotect calls made so far: the fence's cost, two per op for each run of adjacent blocks
  // (docs/notes/fenced-device.md).
  uint64_t protect_calls() const;

 private:
  Result<void*> do_allocate(size_t bytes, size_t alignment, memory::Category category) override;
  void do_deallocate(void* p, size_t bytes, size_t alignment, memory::Category category) override;

  // REQUIRES: mu_ held.
  bool closed_locked() const { return fenced_ && windows_ == 0; }
  void protect_all_locked(bool closed);

  mutable std::mutex mu_;
  std::map<uintptr_t, size_t> blocks_;  // base -> mapped length (page-rounded)
  bool fenced_ = false;
  int windows_ = 0;
  uint64_t protect_calls_ = 0;
};

}  // namespace headroom::backend
