/* What a single-copy read of a buffer costs by the buffer's history: one
 * core owns it, the other reads it with process_vm_readv (as a receiver of
 * single copy does). Each character of PATTERN is a round:
 *
 *   W  the owner writes the buffer, the reader reads it
 *   w  the owner writes it, the reader does not (the rings carry it)
 *   C  the owner leaves it unchanged, the reader reads it
 *   c  unchanged, not read
 *
 *   cc -O2 -Wall -Wextra -Werror -o /tmp/read_after_rings bench/probes/read_after_rings.c
 *   /tmp/read_after_rings 65536 WwccccCCCCwcccCCC
 *
 * Prints each round's read time in us. The first read after rounds on the
 * rings is as slow as a written buffer's; the next ones are not: why the
 * point-to-point choice of single copy tries two sends in a row
 * (src/transport/tagged/choice.rs; results in docs/performance.md, "Point-
 * to-point picks single copy per buffer"). */
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e6 + t.tv_nsec * 1e-3;
}

static void pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  sched_setaffinity(0, sizeof s, &s);
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s BYTES PATTERN\n", argv[0]);
    return 2;
  }
  size_t n = strtoul(argv[1], NULL, 0);
  const char* pattern = argv[2];
  int rounds = (int)strlen(pattern);
  _Atomic int* turn =
      mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  char* buf = aligned_alloc(4096, n);
  char* dst = aligned_alloc(4096, n);
  if (turn == MAP_FAILED || !buf || !dst) return 1;
  memset(buf, 1, n);
  memset(dst, 0, n);
  pid_t owner = getpid();
  pid_t reader = fork();
  if (reader == 0) {
    pin(1);
    for (int r = 0; r < rounds; r++) {
      while (atomic_load(turn) != 2 * r + 1) {
      }
      struct iovec local = {dst, n}, remote = {buf, n};
      double t0 = now_us();
      if (pattern[r] == 'W' || pattern[r] == 'C') {
        if (process_vm_readv(owner, &local, 1, &remote, 1, 0) != (ssize_t)n) return 1;
      }
      printf("%c%.2f ", pattern[r], now_us() - t0);
      atomic_store(turn, 2 * r + 2);
    }
    printf("\n");
    return 0;
  }
  pin(0);
  for (int r = 0; r < rounds; r++) {
    if (pattern[r] == 'W' || pattern[r] == 'w') {
      memset(buf, r, n);
    }
    atomic_store(turn, 2 * r + 1);
    while (atomic_load(turn) != 2 * r + 2) {
    }
  }
  int status = 0;
  waitpid(reader, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
