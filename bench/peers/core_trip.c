/* The round trip of a cache line between two cores: the first two CPUs
 * this process may use, one thread pinned to each, handing a counter back
 * and forth. Prints nanoseconds per trip (the median of 5 rounds).
 *
 * peer_bench.py runs it before and after every launch: a VM's host may put
 * the VM's cores far apart for a few seconds (on this project's 2-core
 * EPYC VM the trip goes from 55-80 ns to 340 ns), and a launch measured
 * then says nothing about the libraries. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define TRIPS 20000L
#define ROUNDS 5

static _Atomic long turn __attribute__((aligned(64)));
static int cpus[2];

/* Whether this thread now runs on `cpu` only. Two spinning threads that
 * share a CPU would hand the line over once a time slice. */
static int pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  return pthread_setaffinity_np(pthread_self(), sizeof s, &s) == 0;
}

static _Atomic int answer_pinned;

static void* answer(void* arg) {
  (void)arg;
  if (!pin(cpus[1])) {
    atomic_store(&answer_pinned, -1);
    return NULL;
  }
  atomic_store(&answer_pinned, 1);
  for (long i = 1; i < 2 * TRIPS * ROUNDS; i += 2) {
    while (atomic_load_explicit(&turn, memory_order_acquire) != i) {
    }
    atomic_store_explicit(&turn, i + 1, memory_order_release);
  }
  return NULL;
}

static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(void) {
  cpu_set_t mine;
  if (sched_getaffinity(0, sizeof mine, &mine) != 0) return 1;
  int n = 0;
  for (int c = 0; c < CPU_SETSIZE && n < 2; c++)
    if (CPU_ISSET(c, &mine)) cpus[n++] = c;
  if (n < 2) {
    printf("nan\n");
    return 0;
  }
  pthread_t t;
  if (!pin(cpus[0]) || pthread_create(&t, NULL, answer, NULL) != 0) {
    printf("nan\n");
    return 0;
  }
  int pinned;
  while ((pinned = atomic_load(&answer_pinned)) == 0) {
  }
  if (pinned < 0) {
    pthread_join(t, NULL);
    printf("nan\n");
    return 0;
  }
  double ns[ROUNDS];
  long at = 0;
  for (int r = 0; r < ROUNDS; r++) {
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < TRIPS; i++, at += 2) {
      atomic_store_explicit(&turn, at + 1, memory_order_release);
      while (atomic_load_explicit(&turn, memory_order_acquire) != at + 2) {
      }
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    ns[r] = ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / TRIPS;
  }
  pthread_join(t, NULL);
  qsort(ns, ROUNDS, sizeof ns[0], cmp);
  printf("%.1f\n", ns[ROUNDS / 2]);
  return 0;
}
