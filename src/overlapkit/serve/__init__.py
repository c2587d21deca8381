"""The plan server (`python -m launch.plan_server` is its command line): `make plan`, `recipes`, `new-recipe`,
`submit`, `sbatch` and `nightly` in about a second once torch and Megatron Bridge are loaded.

Why: `import megatron.bridge` (torch, Megatron Core, every model bridge, modelopt, ...) costs about 30 s
(docs/architecture.md, measured facts), and a command after it about 1 s. One process pays the import; each later
command forks from it.

When: a command that finds no server runs in its own process, as before, paying the import; once it has printed
its result it forks, and the child (own session, output to the log beside the socket) becomes the server, saying
so in one `note:` line (its pid, the idle limit, how to stop it). So a second command typed right after a cold
first one is served, with no second import. A command that finds a server still starting waits for it.

What is loaded in the server, one per user and checkout: torch and Bridge, and whatever the command that became it
imported (a server started by `python -m launch.plan_server --serve`, as `make bench` and the tests do, imports
Bridge and then, by name, the third-party modules a throwaway child loads planning every recipe). Our own modules
(overlapkit.*, recipes.*, launch.*) are never used by a worker: each drops them from sys.modules first.

What is imported fresh for every command: a request (`python -m launch.<cmd> ...` finds the server on a Unix
socket) names the module, from SERVED; a forked worker drops our modules, takes the client's argv, environment,
working directory and stdin/stdout/stderr (the file descriptors themselves, passed over the socket with
SCM_RIGHTS, so rich sees the client's terminal, width and colours exactly as the plain path does; the stamp below
guarantees the same sys.path), runs the module's `cli()` (what its `python -m` entry runs) and reports its exit
status, which the client exits with. Re-importing our code costs about 0.2 s, and it is why an edit to recipes/,
src/ or launch/ shows in the very next command. Bad input, and actions that need no Bridge (status, cancel, ...),
are answered by the client itself (each module's `precheck`), before any server is asked or started.

Restart rules (no command ever runs on a stale stack):
- the server records a stamp at start (`stamp()`: the interpreter, sys.path, uv.lock's hash, the venv's
  pyvenv.cfg and site-packages directories, the content of the files of ours it runs, and the environment
  variables that packages read at import time: HF_*, TORCH*, CUDA*, PYTHON*, LC_*, ...), and the mtime and size
  of every third-party module file it loaded;
- a request whose client computes another stamp, or that finds any of those files changed, is refused: the server
  stops listening, finishes the commands in flight and exits, and the client runs its command itself (so it costs
  what it costs without a server) and then becomes the next server;
- it exits after 15 idle minutes (OVERLAPKIT_PLAN_SERVER_IDLE seconds) and checks its stamp every minute meanwhile.

Never: two checkouts (the socket is named after the checkout's absolute path, and a request naming another
checkout is refused), another user (a 0700 directory, and the peer's uid is checked), a command on a stale stack,
a submission run twice (a worker lost mid-submit is reported, not retried), a traceback where the server cannot
help (one `note:` line, and the command runs in the client's own process), a server inside a Slurm job, or one at
all when OVERLAPKIT_PLAN_SERVER=0 (the test suite sets it, and runs one session server in a private directory
for the tests that ask for it). `make plan-server-stop` stops it.
"""
