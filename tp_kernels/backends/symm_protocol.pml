/*
 * The symm backend's capture-safe signal protocol, as a Promela model for spin.
 *
 * Every value a kernel or a stream operation waits on or stores is a fixed 0/1 flag, so a CUDA
 * graph that captured a sequence of calls can replay it: a replay is the same sequence of calls
 * run again (with new input data). The model runs W ranks, each a current stream (proctype CS)
 * and a side stream (proctype SS), through K recorded calls replayed R times, and checks
 *   (a) every read of a buffer cell sees the data of the reader's own call (versions below);
 *   (b) no cell is overwritten while a read of it is in progress (each read checks the version
 *       at its start and at its end), and no signal word holding an unconsumed 1 is stored to
 *       again;
 *   (c) no deadlock: every rank finishes every call (spin's invalid end states), and at the end
 *       every barrier word has been consumed.
 *
 * Compile-time parameters (spin -D...):
 *   W  ranks (2..3)              C  chunks per shard (all-gather progress words per peer)
 *   K  calls recorded            SEQ  bit i set: recorded call i is a reduce-scatter, else an
 *   R  replays (1 = eager)            all-gather (default 2: AG, RS, AG)
 *   HOST_EPOCHS  the OLD protocol (the mutation): every signal and progress word carries the
 *       call's host epoch e (recorded call index + 1), writers store e, waiters wait for == e,
 *       and nobody clears or consumes. Under replay, call i of replay 2 waits for the same e as
 *       call i of replay 1, which its word still holds: spin must find a stale read.
 *
 * Data is abstracted to versions: a cell holds the global call number g = rep * K + i + 1 of
 * the call whose data it holds (new data each replay), 0 before the first write or after being
 * clobbered. Memory is sequentially consistent: the model assumes the release stores /
 * acquire loads (and the fenced stream writes) of the code order each signal after the data it
 * publishes, which is what they are for.
 *
 * Granularity. A read is two steps (its start and its end check the version), a write one step
 * (stamping the new version), merged with the signal that follows it: a write that starts while
 * a read is in progress is still explored at a moment inside the read (the read's end then sees
 * another version), and nothing happens between a write's start and its end or between its end
 * and its signal that could let a reader start, so merging loses no violation. A wait that
 * succeeds and the read after it are one step: a later start only shortens the read.
 *
 * Where the code is (the lead's names):
 *   inline barrier            tp_kernels/kernels/ag_matmul.py: barrier() / _barrier_kernel
 *   inline ag_call            tp_kernels/backends/symm.py: _ag_triton (the call sequence), with
 *                             ag_matmul.py: ag_matmul_consumer / _ag_matmul_kernel (consumer)
 *   inline rs_call            tp_kernels/backends/symm.py: _rs_triton (the call sequence), with
 *                             tp_kernels/kernels/matmul_rs.py: matmul_rs_producer, reduce_slots
 *   proctype SS, all-gather   tp_kernels/backends/symm_gather.py: Copier.start
 *   proctype SS, reduce-sc.   tp_kernels/backends/symm_scatter.py: Pusher.run
 *
 * Run: spin -a -DW=3 -DC=1 -DK=3 -DSEQ=2 -DR=2 symm_protocol.pml && gcc -O2 -DSAFETY -o pan
 * pan.c && ./pan (tests/test_protocol_model.py runs the configurations it is checked in).
 */

#ifndef W
#define W 2
#endif
#ifndef C
#define C 2
#endif
#ifndef K
#define K 3
#endif
#ifndef R
#define R 1
#endif
#ifndef SEQ
#define SEQ 2
#endif

#define CALLS (K * R)
#define EPOCH(g) ((((g) - 1) % K) + 1)           /* the host's epoch at record time */
#define IS_RS(g) (((SEQ) >> (((g) - 1) % K)) & 1)

#ifdef HOST_EPOCHS
#define SIG(e) (e)
#else
#define SIG(e) 1
#endif

/* --- rank r's signal pad (peers store into it) --- */
#define FREE 0                                   /* barrier A */
#define READY 1                                  /* barrier B */
byte BAR[2 * W * W];                             /* pad_r.FREE[s] / pad_r.READY[s] */
#define PAD(c, r, s) BAR[((c) * W + (r)) * W + (s)]
byte SLOTW[W * W];                               /* pad_r.SLOT[s] */
#define SLOT(r, s) SLOTW[(r) * W + (s)]

/* --- rank r's local words (only r's streams touch them) --- */
byte AGPW[W * W * C];                            /* AGP[s][j] */
#define AGP(r, s, j) AGPW[((r) * W + (s)) * C + (j)]
byte RSPW[W * W];                                /* RSP[d] */
#define RSP(r, d) RSPW[(r) * W + (d)]

/* --- buffer versions --- */
/* One symmetric region per rank, used by every call: as BUF_r by an all-gather (r's published
 * shard, chunk j) and as SLOTS_r by a reduce-scatter (slot s). A shard and the slots may overlap
 * in memory, so a write of either kind clobbers (versions := 0) every cell of the other kind. */
byte BUFV[W * C];
#define BUF(r, j) BUFV[(r) * C + (j)]
byte SLOTSV[W * W];
#define SLOTS(r, s) SLOTSV[(r) * W + (s)]
byte STGV[W * W];                                /* r's local STAGING[d] */
#define STG(r, d) STGV[(r) * W + (d)]
/* r's local gathered A, rows of s, chunk j. A is a fresh allocation per call in the code; the
 * model conservatively reuses one. */
byte AV[W * W * C];
#define A(r, s, j) AV[((r) * W + (s)) * C + (j)]

byte ssgo[W];             /* fork: CS stores its call g; join: SS stores 0 when that call is done */
byte ndone;

/* Store a signal. The new protocol's words are 0 before each store: the previous 1 was consumed
 * (barrier words) or cleared (progress and slot words) before this call's store could happen. */
inline signal(word, e) {
#ifndef HOST_EPOCHS
  assert(word == 0);
#endif
  word = SIG(e)
}

/* A read of a cell by the call g: the data must be this call's at the start and at the end. */
#define READ_OK(v) assert((v) == g)

/* ---------------------------------------------------------------------------------------------
 * tp_kernels/kernels/ag_matmul.py: barrier() launches _barrier_kernel on r's current stream:
 * one program per peer p != r, running concurrently (the do-loop below picks any program that
 * can take a step). Program p: [clear] -> release-store pad_p.c[r] := 1 -> acquire-wait
 * pad_r.c[p] == 1 -> store pad_r.c[p] := 0. The kernel (and so the inline) ends when every
 * program has.
 * ------------------------------------------------------------------------------------------- */
#define PH_ARRIVE 1
#define PH_WAIT 2
#define PH_CONSUME 3
#define PH_DONE 4

/* Program p's clear (clear=True only): AGP[p][*], RSP[p], SLOT[p] and the own-block SLOT[r]. */
inline clear_words(p) {
#ifndef HOST_EPOCHS
  j = 0;
  do
  :: j < C -> AGP(r, p, j) = 0; j++
  :: else -> break
  od;
  j = 0;
  RSP(r, p) = 0;
  SLOT(r, p) = 0;
  SLOT(r, r) = 0
#else
  skip                                           /* the old protocol clears nothing */
#endif
}

/* The steps of program p, options of the barrier's do-loop (a macro: inline bodies cannot be
 * options). The clear and the arrival are one step: the cleared words are r's own (and r's pad
 * words that only p stores to), which nothing reads or writes until the arrival has been seen
 * (a store into them before it would trip the assertion in signal()). */
#ifdef HOST_EPOCHS
#define PROGRAM_STEPS(p) \
  :: atomic { ph[p] == PH_ARRIVE -> signal(PAD(c, p, r), e); ph[p] = PH_WAIT } \
  :: atomic { ph[p] == PH_WAIT && PAD(c, r, p) == SIG(e) -> ph[p] = PH_DONE }
#else
#define PROGRAM_STEPS(p) \
  :: atomic { ph[p] == PH_ARRIVE -> \
       if :: clear -> clear_words(p) :: else -> skip fi; \
       signal(PAD(c, p, r), e); ph[p] = PH_WAIT } \
  :: atomic { ph[p] == PH_WAIT && PAD(c, r, p) == SIG(e) -> ph[p] = PH_CONSUME } \
  :: atomic { ph[p] == PH_CONSUME -> PAD(c, r, p) = 0; ph[p] = PH_DONE }
#endif

#if W > 2
#define ALL_DONE (ph[0] == PH_DONE && ph[1] == PH_DONE && ph[2] == PH_DONE)
#else
#define ALL_DONE (ph[0] == PH_DONE && ph[1] == PH_DONE)
#endif

inline barrier(which, clear) {
  d_step {
    c = which;
    n = 0;
    do
    :: n < W -> ph[n] = (n == r -> PH_DONE : PH_ARRIVE); n++
    :: else -> break
    od;
    n = 0
  }
  do
  PROGRAM_STEPS(0)
  PROGRAM_STEPS(1)
#if W > 2
  PROGRAM_STEPS(2)
#endif
#if W > 3
#error "the barrier loop has programs for W <= 3"
#endif
  :: atomic {
       ALL_DONE -> n = 0; do :: n < W -> ph[n] = 0; n++ :: else -> break od; n = 0; c = 0
     };
     break
  od
}

/* ---------------------------------------------------------------------------------------------
 * tp_kernels/backends/symm.py: _ag_triton, the all-gather-matmul call on rank r (current stream).
 * ------------------------------------------------------------------------------------------- */
inline ag_call() {
  barrier(FREE, 1);
  atomic {           /* publish: r's shard into BUF_r (peers read it), own rows into the local A */
    j = 0;
    do
    :: j < C -> BUF(r, j) = g; A(r, r, j) = g; j++
    :: else -> break
    od;
    j = 0;
    do
    :: j < W -> SLOTS(r, j) = 0; j++                 /* the shard may overlap any slot */
    :: else -> break
    od;
    j = 0
  }
  barrier(READY, 0);
  ssgo[r] = g;                                       /* fork: the copier (SS) */
  /* tp_kernels/kernels/ag_matmul.py: ag_matmul_consumer / _ag_matmul_kernel. Own rows first,
   * then each peer chunk after its progress word. The kernel's tiles run in parallel; one reader
   * per chunk in order, each read one step, loses nothing: a chunk's cell of A is local and
   * written only by its copy, before its word, and by the next call's copy, after the join
   * below, so every moment between the wait and the end of the call is equivalent for (a) and
   * (b), and the one check stands for the read's start and end. */
  d_step {
    j = 0;
    do
    :: j < C -> READ_OK(A(r, r, j)); j++
    :: else -> break
    od;
    j = 0
  }
  n = 1;
  do
  :: n < W ->
     s = (r + n) % W;
     j = 0;
     do
     :: j < C ->
        atomic { AGP(r, s, j) == SIG(e) -> READ_OK(A(r, s, j)); j++ }   /* wait, then read */
     :: else -> break
     od;
     n++
  :: else -> break
  od;
  atomic { ssgo[r] == 0 -> n = 0; s = 0; j = 0 }     /* join */
}

/* ---------------------------------------------------------------------------------------------
 * tp_kernels/backends/symm.py: _rs_triton, the matmul-reduce-scatter call on rank r.
 * ------------------------------------------------------------------------------------------- */
inline rs_call() {
  barrier(FREE, 1);
  ssgo[r] = g;             /* fork: the pusher (SS), enqueued after the producer's launch */
  /* tp_kernels/kernels/matmul_rs.py: matmul_rs_producer. Blocks d = r+1, ..., r (own last);
   * each block's write and its signal are one step (see "Granularity" above). */
  n = 1;
  do
  :: n < W ->
     d_step {
       s = (r + n) % W;
       STG(r, s) = g;                                /* block s into STAGING[s] */
       signal(RSP(r, s), e);                         /* RSP[s] := 1 (release) */
       n++
     }
  :: else -> break
  od;
  atomic {
    SLOTS(r, r) = g;                                 /* the own block into SLOTS_r[r] */
    j = 0;
    do
    :: j < C -> BUF(r, j) = 0; j++                   /* a slot may overlap the shard */
    :: else -> break
    od;
    j = 0;
    signal(SLOT(r, r), e);                           /* the own pad's SLOT[r] := 1 */
    s = 0
  }
  /* tp_kernels/kernels/matmul_rs.py: reduce_slots. Slots in order 0..W-1; each read begins
   * with its wait's success and ends in a step of its own. */
  do
  :: s < W ->
     atomic { SLOT(r, s) == SIG(e) -> READ_OK(SLOTS(r, s)) }     /* wait, read begins */
     d_step { READ_OK(SLOTS(r, s)); s++ }                        /* read ends (added) */
  :: else -> break
  od;
  atomic { ssgo[r] == 0 -> n = 0; s = 0 }            /* join */
}

proctype CS(byte r) {
  byte g, e, c, n, s, j;
  byte ph[W];
  do
  :: g < CALLS ->
     d_step { g++; e = EPOCH(g) }
     if
     :: IS_RS(g) -> rs_call()
     :: else -> ag_call()
     fi
  :: else -> break
  od;
  /* every rank finished every call; every barrier arrival was consumed */
  ndone++;
  ndone == W;
#ifndef HOST_EPOCHS
  n = 0;
  do
  :: n < W -> assert(PAD(FREE, r, n) == 0 && PAD(READY, r, n) == 0); n++
  :: else -> break
  od
#endif
}

/* ---------------------------------------------------------------------------------------------
 * The side stream SS of rank r, forked after the barrier(s) of each call, joined at its end:
 * the copier of an all-gather or the pusher of a reduce-scatter. A copy is two steps: its read
 * of the source begins; its read ends together with the write of the destination and the
 * signal after it.
 * ------------------------------------------------------------------------------------------- */
proctype SS(byte r) {
  byte g, e, n, s, j;
end_idle:
  do
  :: ssgo[r] != 0 ->
     d_step { g = ssgo[r]; e = EPOCH(g); n = 1 }
     if
     :: !IS_RS(g) ->
        /* tp_kernels/backends/symm_gather.py: Copier.start. For s = r+1, ... and chunk j: copy
         * chunk j of BUF_s into A's rows of s, then AGP[s][j] := 1 (a fenced stream write). */
        do
        :: n < W ->
           s = (r + n) % W;
           j = 0;
           do
           :: j < C ->
              d_step { READ_OK(BUF(s, j)) }                       /* copy begins */
              d_step {
                READ_OK(BUF(s, j)); A(r, s, j) = g;               /* copy ends */
                signal(AGP(r, s, j), e);
                j++
              }
           :: else -> break
           od;
           n++
        :: else -> break
        od
     :: else ->
        /* tp_kernels/backends/symm_scatter.py: Pusher.run. For d = r+1, ... (d != r): wait
         * RSP[d]; copy STAGING[d] into slot r of peer d's region; pad_d.SLOT[r] := 1. */
        do
        :: n < W ->
           s = (r + n) % W;
           atomic { RSP(r, s) == SIG(e) -> READ_OK(STG(r, s)) }   /* wait, copy begins */
           d_step {
             READ_OK(STG(r, s)); SLOTS(s, r) = g;                 /* copy ends */
             j = 0;
             do
             :: j < C -> BUF(s, j) = 0; j++                       /* a slot may overlap the shard */
             :: else -> break
             od;
             j = 0;
             signal(SLOT(s, r), e);
             n++
           }
        :: else -> break
        od
     fi;
     atomic { g = 0; e = 0; n = 0; s = 0; j = 0; ssgo[r] = 0 }     /* the call's join */
  od
}

init {
  byte r;
  atomic {
    do
    :: r < W -> run CS(r); run SS(r); r++
    :: else -> break
    od
  }
}
