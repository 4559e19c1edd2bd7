"""The `zoo` command (commands.py: run, chat, serve, info, pull, bench), its interactive chat
(chat_session.py) and its benchmarks (bench.py; bench_llamacpp.py and bench_worker.py: the
comparison with llama.cpp in processes of their own)."""
