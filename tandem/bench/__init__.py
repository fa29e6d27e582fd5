"""`tandem bench ...`: the serving benchmark (`serve`), with vLLM `bench serve`'s report and result fields."""
