/*
 * The symm backend's capture-safe signal protocol, as a Promela model for spin.
 *
 * Every value a kernel or a stream operation waits on or stores is a fixed 0/1 flag, so a CUDA
 * graph that captured a sequence of calls can replay it: a replay is the same sequence of calls
 * run again (with new input data). The model runs W ranks, each a current stream (proctype CS)
 * and a side stream (proctype SS), through K recorded calls replayed R times, and checks
 *   (a) every read of a buffer cell sees the data of the reader's own call (versions below);
 *   (b) no cell is overwritten while a read of it is in progress (each read checks the version
 *       at its start and at its end; every write stamps 0 = "being written" at its start), and
 *       no signal word holding an unconsumed 1 is stored to again;
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
 * the call whose data it holds (new data each replay), 0 while being written or after being
 * clobbered. Memory is sequentially consistent: the model assumes the release stores /
 * acquire loads (and the fenced stream writes) of the code order each signal after the data it
 * publishes, which is what they are for.
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

byte cur[W];                                     /* the call r's current stream is in */
bool ssgo[W];                                    /* fork (CS := 1) / join (SS := 0) */
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
#define PH_CLEAR 0
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
 * options). */
#ifdef HOST_EPOCHS
#define PROGRAM_STEPS(p) \
  :: atomic { ph[p] == PH_CLEAR -> clear_words(p); ph[p] = PH_ARRIVE } \
  :: atomic { ph[p] == PH_ARRIVE -> signal(PAD(c, p, r), e); ph[p] = PH_WAIT } \
  :: atomic { ph[p] == PH_WAIT && PAD(c, r, p) == SIG(e) -> ph[p] = PH_DONE }
#else
#define PROGRAM_STEPS(p) \
  :: atomic { ph[p] == PH_CLEAR -> clear_words(p); ph[p] = PH_ARRIVE } \
  :: atomic { ph[p] == PH_ARRIVE -> signal(PAD(c, p, r), e); ph[p] = PH_WAIT } \
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
    :: n < W -> ph[n] = (n == r -> PH_DONE : (clear -> PH_CLEAR : PH_ARRIVE)); n++
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
  /* publish: r's shard into BUF_r (peers read it), own rows into the local A */
  atomic {
    j = 0;
    do
    :: j < C -> BUF(r, j) = 0; A(r, r, j) = 0; j++
    :: else -> break
    od;
    j = 0;
    do
    :: j < W -> SLOTS(r, j) = 0; j++                /* the shard may overlap any slot */
    :: else -> break
    od;
    j = 0
  }
  d_step {
    j = 0;
    do
    :: j < C -> BUF(r, j) = g; A(r, r, j) = g; j++
    :: else -> break
    od;
    j = 0
  }
  barrier(READY, 0);
  ssgo[r] = 1;                                      /* fork: the copier (SS) */
  /* tp_kernels/kernels/ag_matmul.py: ag_matmul_consumer / _ag_matmul_kernel. Own rows first,
   * then each peer chunk after its progress word. The tiles run in parallel in the kernel; one
   * reader per chunk in order loses nothing: a chunk's cell is written only by its copy, before
   * its word, and by the next call's copy, after the join below, so every moment between the
   * wait and the end of the call is equivalent for (a) and (b). */
  j = 0;
  do
  :: j < C -> READ_OK(A(r, r, j)); j++
  :: else -> break
  od;
  n = 1;
  do
  :: n < W ->
     s = (r + n) % W;
     j = 0;
     do
     :: j < C ->
        AGP(r, s, j) == SIG(e);                     /* wait (acquire); does not consume */
        READ_OK(A(r, s, j));                        /* read begins */
        READ_OK(A(r, s, j));                        /* read ends */
        j++
     :: else -> break
     od;
     n++
  :: else -> break
  od;
  atomic { n = 0; s = 0; j = 0 }
  ssgo[r] == 0                                      /* join */
}

/* ---------------------------------------------------------------------------------------------
 * tp_kernels/backends/symm.py: _rs_triton, the matmul-reduce-scatter call on rank r.
 * ------------------------------------------------------------------------------------------- */
inline rs_call() {
  barrier(FREE, 1);
  ssgo[r] = 1;             /* fork: the pusher (SS), enqueued after the producer's launch */
  /* tp_kernels/kernels/matmul_rs.py: matmul_rs_producer. Blocks d = r+1, ..., r (own last). */
  n = 1;
  do
  :: n <= W ->
     s = (r + n) % W;
     if
     :: s != r ->
        STG(r, s) = 0;                              /* computing block s into STAGING[s] */
        STG(r, s) = g;
        signal(RSP(r, s), e)                        /* release */
     :: else ->
        d_step {                                    /* computing the own block into SLOTS_r[r] */
          SLOTS(r, r) = 0;
          j = 0;
          do
          :: j < C -> BUF(r, j) = 0; j++            /* a slot may overlap the shard */
          :: else -> break
          od;
          j = 0
        }
        SLOTS(r, r) = g;
        signal(SLOT(r, r), e)
     fi;
     n++
  :: else -> break
  od;
  /* tp_kernels/kernels/matmul_rs.py: reduce_slots. Slots in order 0..W-1. */
  s = 0;
  do
  :: s < W ->
     SLOT(r, s) == SIG(e);                          /* wait (acquire) */
     READ_OK(SLOTS(r, s));                          /* read begins */
     READ_OK(SLOTS(r, s));                          /* read ends (added) */
     s++
  :: else -> break
  od;
  atomic { n = 0; s = 0 }
  ssgo[r] == 0                                      /* join */
}

proctype CS(byte r) {
  byte g, e, c, n, s, j;
  byte ph[W];
  do
  :: g < CALLS ->
     d_step { g++; e = EPOCH(g); cur[r] = g }
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
 * the copier of an all-gather or the pusher of a reduce-scatter.
 * ------------------------------------------------------------------------------------------- */
proctype SS(byte r) {
  byte g, e, n, s, j;
end_idle:
  do
  :: ssgo[r] ->
     d_step { g = cur[r]; e = EPOCH(g) }
     if
     :: !IS_RS(g) ->
        /* tp_kernels/backends/symm_gather.py: Copier.start. For s = r+1, ... and chunk j: copy
         * chunk j of BUF_s into A's rows of s, then AGP[s][j] := 1 (a fenced stream write). */
        n = 1;
        do
        :: n < W ->
           s = (r + n) % W;
           j = 0;
           do
           :: j < C ->
              d_step { READ_OK(BUF(s, j)); A(r, s, j) = 0 }     /* copy begins */
              d_step { READ_OK(BUF(s, j)); A(r, s, j) = g }     /* copy ends */
              signal(AGP(r, s, j), e);
              j++
           :: else -> break
           od;
           n++
        :: else -> break
        od
     :: else ->
        /* tp_kernels/backends/symm_scatter.py: Pusher.run. For d = r+1, ... (d != r): wait
         * RSP[d]; copy STAGING[d] into slot r of peer d's region; pad_d.SLOT[r] := 1. */
        n = 1;
        do
        :: n < W ->
           s = (r + n) % W;
           RSP(r, s) == SIG(e);                                 /* wait */
           d_step {                                             /* copy begins */
             READ_OK(STG(r, s));
             SLOTS(s, r) = 0;
             j = 0;
             do
             :: j < C -> BUF(s, j) = 0; j++                     /* a slot may overlap the shard */
             :: else -> break
             od;
             j = 0
           }
           d_step { READ_OK(STG(r, s)); SLOTS(s, r) = g }       /* copy ends */
           signal(SLOT(s, r), e);
           n++
        :: else -> break
        od
     fi;
     atomic { g = 0; e = 0; n = 0; s = 0; j = 0 }
     ssgo[r] = 0                                                /* the call's join */
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
