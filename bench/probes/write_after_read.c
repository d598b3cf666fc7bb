/* What single copy costs the sender after the call: the time to write a
 * buffer again once another core has read it (as a receiver's
 * process_vm_readv does) against once nobody has.
 *
 *   cc -O2 -Wall -Wextra -Werror -o /tmp/write_after_read bench/probes/write_after_read.c
 *   /tmp/write_after_read 65536
 *
 * The owner runs on cpu 0, the reader on cpu 1; each round the reader reads
 * the buffer (or not) and the owner then times memset over it. Results are
 * in docs/performance.md ("Messages over 16 KiB stream through the rings"). */
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
  (void)sched_setaffinity(0, sizeof s, &s);
}

int main(int argc, char** argv) {
  size_t n = argc > 1 ? (size_t)atol(argv[1]) : 65536;
  const int reps = 2000;
  char* buf = aligned_alloc(4096, (n + 4095) / 4096 * 4096);
  memset(buf, 1, n);
  int to_reader[2], to_owner[2];
  if (pipe(to_reader) || pipe(to_owner)) return 1;
  pid_t owner = getpid();
  if (fork() == 0) {
    close(to_reader[1]);
    pin(1);
    char* mine = aligned_alloc(4096, (n + 4095) / 4096 * 4096);
    memset(mine, 0, n);
    char cmd;
    while (read(to_reader[0], &cmd, 1) == 1) {
      if (cmd == 'R') {
        struct iovec local = {mine, n}, remote = {buf, n};
        if (process_vm_readv(owner, &local, 1, &remote, 1, 0) != (ssize_t)n) _exit(1);
      }
      if (write(to_owner[1], &cmd, 1) != 1) _exit(1);
    }
    _exit(0);
  }
  pin(0);
  for (int read_first = 0; read_first < 2; read_first++) {
    double total = 0;
    for (int i = 0; i < reps; i++) {
      char cmd = read_first ? 'R' : 'N';
      if (write(to_reader[1], &cmd, 1) != 1 || read(to_owner[0], &cmd, 1) != 1) return 1;
      double t0 = now_us();
      memset(buf, i & 0xff, n);
      total += now_us() - t0;
    }
    printf("%zu B: writing it again after the other core %s: %.2f us\n", n,
           read_first ? "read it" : "did not", total / reps);
  }
  close(to_reader[1]);
  wait(NULL);
  return 0;
}
