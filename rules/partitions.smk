# Client partitions are pipeline artifacts: one file per dataset x scheme x seed, shared by every
# method so that all methods of an experiment see exactly the same clients.
from fedcore.partition.registry import scheme_modules


rule partition:
    input:
        dataset_file("{dataset}"),
        code=code("make_partition.py", *scheme_modules()),  # every scheme module: the registry imports them all
    output:
        partition=f"{RESULTS}/partitions/{{dataset}}/{{pid}}/seed{{seed}}.npz",
        counts=f"{RESULTS}/partitions/{{dataset}}/{{pid}}/seed{{seed}}.counts.csv",
        png=f"{RESULTS}/partitions/{{dataset}}/{{pid}}/seed{{seed}}.heatmap.png",
        pdf=f"{RESULTS}/partitions/{{dataset}}/{{pid}}/seed{{seed}}.heatmap.pdf",
    params:
        spec=partition_spec,
    log:
        f"{RESULTS}/logs/partition/{{dataset}}/{{pid}}/seed{{seed}}.log",
    resources:
        runtime=10,
        mem_mb=8000,
    script:
        "../workflow/scripts/make_partition.py"
