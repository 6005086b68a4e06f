"""`adaflash demo`: the closed learning loop (serve, distil, hot-reload) on one machine.

``loop`` runs it, ``procs`` owns the two child processes, ``workload`` the prompts, ``client``
the `openai` clients and the ``/ready`` poller, ``report`` the table, plot and results.json, and
``check`` the final T=0 comparison with plain decoding. docs/serving.md, "The closed loop".
"""
