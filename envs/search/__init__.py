"""Search env `Search-v0` (Search-R1), retrievers (BM25 on bm25s, dense on sentence-transformers + faiss,
Search-R1's remote API), the Search-R1-compatible retrieval server, rewards, corpora and task loaders."""

from slime_env.envs.search.corpus import (Passage, demo_corpus, demo_questions, format_passages, read_corpus,
                                          write_corpus)
from slime_env.envs.search.data import load_search_tasks, search_row_to_task, search_tasks
from slime_env.envs.search.retrievers import (BM25Retriever, DenseRetriever, RemoteRetriever, Retriever,
                                              default_dense_model, load_retriever)
from slime_env.envs.search.rewards import SearchReward, exact_match, f1_score, normalize_answer, substring_exact_match
from slime_env.envs.search.teacher import teacher_reply

__all__ = ["BM25Retriever", "DenseRetriever", "Passage", "RemoteRetriever", "Retriever", "SearchReward",
           "default_dense_model", "demo_corpus", "demo_questions", "exact_match", "f1_score", "format_passages",
           "load_retriever", "load_search_tasks", "normalize_answer", "read_corpus", "search_row_to_task",
           "search_tasks", "substring_exact_match", "teacher_reply", "write_corpus"]
