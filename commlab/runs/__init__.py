"""The run vocabulary that the measurement harness and the cost model share (torch-free).

- config.py: one configuration (Config), its defaults and its columns;
- grid.py: a sweep grid (Grid) from defaults, a YAML spec and the command line;
- options.py: parsing option values (lists, sizes, model arguments);
- zero_stage.py: what a ZeRO stage shards (stage 0: nothing, DDP), the one parser of a stage;
- store.py: records and the tidy CSVs of a results directory; stats.py: their summaries;
- traffic.py: bytes per collective, and sizes written as "64M".
"""
